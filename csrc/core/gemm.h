/* Blocking parameters of the packed GEMM (core/gemm.c), per dtype and ISA. Template header:
 * included with dtype.h's macros in force.
 *
 * The micro-kernel keeps an MR x NR tile of C in MR*NV vector registers (NR = NV*VL):
 * 6 x 2 = 12 accumulators, enough independent FMAs to cover a 4-cycle latency on 2 ports,
 * and 12 + 2 (B) + 1 (broadcast A) <= 16 registers for SSE/AVX2/NEON. AVX-512 has 32
 * registers and takes MR = 12.
 * A block is MC x KC (stays in L2), a B micro-panel KC x NR (stays in L1 when packed; read in
 * place, its rows ldb apart, it may map to few L1 sets and stream from L2), B block KC x NC.
 */
#undef MR
#undef NV
#undef NR
#undef KC
#undef MC
#undef NC

#if PA_VBYTES == 64
#define MR 12
#else
#define MR 6
#endif
#define NV 2
#define NR (NV * VL)
#define KC (PA_DOUBLE ? 128 : 256)
#define MC (MR * 16)
#define NC (NR * 64)
