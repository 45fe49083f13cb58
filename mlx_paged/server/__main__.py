"""``python -m mlx_paged.server``."""

from . import main

main()
