"""Run mlx-lm's own HTTP server, ``mlx_lm.server``, on a model loaded here, dense or paged.

    python tests/mlxlm_server_launcher.py MODEL_DIR --port-file FILE [--paged] [SERVER FLAGS]

Used by ``test_mlxlm_server.py``. It loads ``MODEL_DIR`` in float32 on the CPU,
calls ``install_paged_cache(model)`` with ``--paged``, and then runs
``mlx_lm.server.main()`` unchanged (its own argparse, ``ModelProvider``,
``ResponseGenerator`` and HTTP handler), with three launcher-side hooks:

- ``mlx_lm.server.load`` returns the model loaded here instead of reading
  ``--model`` from disk again (how to serve an already-loaded model object);
- the server's port (``--port 0`` picks a free one) is written to ``--port-file``
  once it listens;
- ``GET /mlx_paged/stats`` reports the cache types, the pools' block counts and the
  largest batch a batch cache was asked to hold, so the test can tell the paged
  server really ran paged, and batched.

Threads and MLX streams: mlx_lm.server runs every model call on its generation
thread. MLX streams are per thread, and an array that is still lazy remembers
the stream of the thread that built it; evaluating it on another thread raises
``RuntimeError: There is no Stream(cpu, 0) in current thread``. The float32
cast below (like ``mlx_paged.embedded.load_model``) is such a lazy array, so
the model is evaluated here, on the main thread, before the server starts. The
real ``mlx_lm.server`` never meets this: it loads inside its generation thread.
The dense run imports nothing from mlx_paged, so it is mlx-lm as shipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import ThreadingHTTPServer

import mlx.core as mx

# Before mlx-lm is imported (as tests/conftest.py): mlx-lm makes its generation stream then.
mx.set_default_device(mx.cpu)

import mlx_lm.server as server  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

STATS_PATH = "/mlx_paged/stats"


def load_float32(path: str):
    """``mlx_lm.load`` a model directory and cast its floating-point parameters to float32."""
    model, tokenizer, config = load(path, return_config=True)
    model.update(
        tree_map(
            lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters(),
        )
    )
    materialize(model)
    return model, tokenizer, config


def materialize(model) -> None:
    """Evaluate every array the model holds, private ones (e.g. RoPE frequencies) too.

    A lazy array built on this thread cannot be evaluated on the server's
    generation thread (see the module docstring).
    """
    everything = model.filter_and_map(lambda module, key, value: True)
    mx.eval([x for _, x in tree_flatten(everything) if isinstance(x, mx.array)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("model", help="an mlx-lm model directory")
    parser.add_argument("--port-file", required=True, help="written with the port once listening")
    parser.add_argument("--paged", action="store_true", help="install_paged_cache(model) first")
    parser.add_argument("--block-size", type=int, default=16)
    args, server_argv = parser.parse_known_args(argv)

    model, tokenizer, config = load_float32(args.model)
    stats: dict = {"paged": args.paged, "max_batch": 0, "batch_generators": 0}

    def watch_batches(cls: type) -> None:
        """Record the largest batch ``cls.update_and_fetch`` sees."""
        update = cls.update_and_fetch

        def update_and_fetch(self, keys, values):
            stats["max_batch"] = max(stats["max_batch"], keys.shape[0])
            return update(self, keys, values)

        cls.update_and_fetch = update_and_fetch

    if args.paged:
        from mlx_paged import PagedBatchKVCache, install_paged_cache

        install_paged_cache(model, block_size=args.block_size)
        watch_batches(PagedBatchKVCache)
    watch_batches(BatchKVCache)
    stats["cache_types"] = sorted({type(c).__name__ for c in make_prompt_cache(model)})

    def fake_load(path, *unused, return_config=False, **kwargs):
        return (model, tokenizer, config) if return_config else (model, tokenizer)

    server.load = fake_load

    batch_generator = server.BatchGenerator

    def counting_batch_generator(*a, **kw):
        stats["batch_generators"] += 1
        return batch_generator(*a, **kw)

    server.BatchGenerator = counting_batch_generator

    def report(handler) -> dict:
        out = dict(stats, is_batchable=handler.response_generator.model_provider.is_batchable)
        out["mlx_paged_imported"] = "mlx_paged" in sys.modules
        pools = getattr(model.make_cache, "pools", {}) if args.paged else {}
        out["pools"] = []
        for pool in pools.values():
            s = pool.blocks.stats()
            out["pools"].append(
                {k: getattr(s, k) for k in ("total_blocks", "live_blocks", "cached_blocks")}
            )
        return out

    do_get = server.APIHandler.do_GET

    def do_GET(self):
        if self.path != STATS_PATH:
            return do_get(self)
        body = json.dumps(report(self)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    server.APIHandler.do_GET = do_GET

    activate = ThreadingHTTPServer.server_activate

    def server_activate(self):
        activate(self)
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(self.server_address[1]))
        os.replace(tmp, args.port_file)

    ThreadingHTTPServer.server_activate = server_activate

    sys.argv = ["mlx_lm.server", "--model", args.model, *server_argv]
    server.main()


if __name__ == "__main__":
    main()
