/* One decoder layer of a Llama-style model for a step of a few rows (each a one-token query: see
 * kernels/cpu_decode_layer.py), in one call:
 *
 *   normed, residual' = rms_norm(x + residual)             (residual NULL at layer 0: residual' = x)
 *   qkv   = normed . W_qkv^T (+ b)                        [m, (H + 2 Hkv) D]
 *   q     = rotary(q); k = rotary(k); store k, v in their cache slots
 *   attn  = paged decode attention(q) over the cache      [m, H, D] fp32
 *   o     = attn . W_o^T (+ b)                            [m, hidden]
 *   normed2, residual_out = rms_norm(o + residual')
 *   out   = (silu(gate) * up)(normed2 . W_gate_up^T) . W_down^T
 *
 * It runs the very kernels the fused decode path calls one by one from Python (small_linear.c,
 * rms_norm.c, rotary_store.c, paged_decode_attention.c, silu_mul.c, included here), in the same
 * order with the same roundings, so its output is bit for bit theirs. What it saves is the
 * interpreter between them: at one row a step is ~250 kernel calls of microseconds each, and the
 * Python, ctypes and tensor allocations around each cost about as much as the call (about a
 * third of a 135M model's decode step on 2 cores). Each kernel keeps its own parallel loop on the
 * calling thread's OpenMP team.
 *
 * Dtypes: x, residual, out, residual_out, the norms' weights, cos/sin and the caches share the
 * model dtype (bf16 when is_bf16, else fp32); each projection's weight is bf16 or fp32 (its
 * flag), biases fp32 or NULL. Scratch buffers are allocated per call (a few hundred KiB at most).
 * Returns 0, -1 when out of memory, -2 when the attention kernel refuses the shape (nothing
 * written to out then; the cache slots may have been written, as the separate calls would).
 */
#include "small_linear.c"
#include "rms_norm.c"
#include "rotary_store.c"
#include "silu_mul.c"
#include "paged_decode_attention.c"

struct decode_layer_weights {
    const void *input_norm, *post_norm;            /* [hidden] model dtype */
    const void *qkv, *o, *gate_up, *down;          /* [out, in] row-major */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;  /* fp32 [out] or NULL */
    int qkv_bf16, o_bf16, gate_up_bf16, down_bf16;  /* weight dtypes */
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale, softcap;                      /* softcap 0: none */
    int64_t window;                                 /* sliding window, 0: none */
    int is_bf16;                                    /* the model dtype */
};

struct decode_layer_step {
    int64_t rows;                                   /* one new token per sequence */
    const void *cos, *sin;                          /* [rows, head_dim] model dtype */
    const int64_t *slots;                           /* [rows] cache slot of each new token */
    const int32_t *block_tables;                    /* [rows, table_stride] */
    int64_t table_stride;
    const int32_t *seq_lens;                        /* [rows], the new token included */
    int64_t block_size;
    int num_threads;
};

int decode_layer(const struct decode_layer_weights *w, const struct decode_layer_step *s,
                 void *k_cache, void *v_cache, const void *x, const void *residual, void *out,
                 void *residual_out) {
    const int64_t m = s->rows, d = w->hidden, hd = w->head_dim;
    const int64_t q_width = w->num_heads * hd, qkv_width = (w->num_heads + 2 * w->num_kv_heads) * hd;
    const size_t el = w->is_bf16 ? 2 : 4;
    const int bf = w->is_bf16, threads = s->num_threads;
    /* scratch: normed [m, d], qkv [m, qkv_width], o [m, d], normed2 [m, d], gate_up [m, 2I],
     * act [m, I] in the model dtype; q and attn [m, H D] fp32 */
    size_t model_elems = (size_t)(m * (3 * d + qkv_width + 3 * w->intermediate));
    char *scratch = (char *)malloc(model_elems * el + (size_t)(2 * m * q_width) * sizeof(float));
    if (scratch == NULL) return -1;
    char *p = scratch;
    void *normed = p; p += (size_t)(m * d) * el;
    void *qkv = p; p += (size_t)(m * qkv_width) * el;
    void *o = p; p += (size_t)(m * d) * el;
    void *normed2 = p; p += (size_t)(m * d) * el;
    void *gate_up = p; p += (size_t)(m * 2 * w->intermediate) * el;
    void *act = p; p += (size_t)(m * w->intermediate) * el;
    float *q = (float *)p, *attn = q + m * q_width;
    int rc = 0;

    rms_norm(x, residual, residual ? residual_out : NULL, normed, w->input_norm, m, d, w->eps, bf, threads);
    const void *stream = residual ? residual_out : x;  /* residual' */
    if (small_linear(normed, bf, w->qkv, w->qkv_bf16, w->qkv_bias, qkv, bf, m, qkv_width, d, threads)) {
        rc = -1;
        goto done;
    }
    rotary_store(qkv, s->cos, s->sin, k_cache, v_cache, s->slots, q, m, w->num_heads, w->num_kv_heads, hd, bf);
    if (paged_decode_attention(q, k_cache, v_cache, s->block_tables, s->table_stride, s->seq_lens, attn, m,
                               w->num_heads, w->num_kv_heads, hd, s->block_size, bf, w->scale, w->window,
                               w->softcap, threads)) {
        rc = -2;
        goto done;
    }
    if (small_linear(attn, 0, w->o, w->o_bf16, w->o_bias, o, bf, m, d, q_width, threads) ||
        (rms_norm(o, stream, residual_out, normed2, w->post_norm, m, d, w->eps, bf, threads),
         small_linear(normed2, bf, w->gate_up, w->gate_up_bf16, w->gate_up_bias, gate_up, bf, m,
                      2 * w->intermediate, d, threads))) {
        rc = -1;
        goto done;
    }
    silu_mul(gate_up, act, m, w->intermediate, bf, threads);
    if (small_linear(act, bf, w->down, w->down_bf16, w->down_bias, out, bf, m, d, w->intermediate, threads))
        rc = -1;
done:
    free(scratch);
    return rc;
}
