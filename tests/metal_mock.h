// Just enough of the Metal Shading Language, as C++, to parse the Metal build of the
// paged kernels with a host C++ compiler (tests/test_kernel_sources.py). It checks that
// the Metal build is valid C++ with the prelude's spellings; it is not a Metal compiler.
#include <cstdint>
#define device
#define thread
#define threadgroup
#define constant
typedef unsigned int uint;
typedef unsigned short ushort;
struct uint3 { uint x, y, z; };
struct uint2 { uint x, y; };
struct uint4 {
  uint x, y, z, w;
  uint4() = default;
  explicit uint4(uint v) : x(v), y(v), z(v), w(v) {}
  uint4(uint a, uint b, uint c, uint d) : x(a), y(b), z(c), w(d) {}
};
enum class mem_flags { mem_none, mem_threadgroup, mem_device };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <typename X> X simd_shuffle_xor(X x, ushort mask);
template <typename To, typename From> To as_type(From);
namespace metal {
float exp2(float);
float max(float, float);
template <typename X> struct numeric_limits { static X infinity(); };
}  // namespace metal
using namespace metal;
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
struct float16_t { float v; float16_t() = default; float16_t(float f) : v(f) {} operator float() const { return v; } };
