// What stream_gemv.cu and stream_rows.cu share after prelude.cuh: a block's rows and its
// stages' mbarriers.
// this block's weight rows [r0, r0 + nr): N over the grid, balanced to within one row
#define BLOCK_ROWS const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31; \
    const int b = blockIdx.x, G = gridDim.x; \
    const int r0 = (int)((long long)N * b / G), nr = (int)((long long)N * (b + 1) / G) - r0; \
    const unsigned FULL = 0xffffffffu
// a warp's stages are warp, warp + NW, ... (NS is a multiple of NW): only it uses them
__device__ __forceinline__ void init_stages(u64* full, int warp) {
    for (int s = warp; s < NS; s += NW) mbar_init(&full[s], 1);
    mbar_fence_init();
}
