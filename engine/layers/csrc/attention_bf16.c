/* paged_attention_kv_bf16: attention.c's kernels over a bfloat16 KV cache (its keys and
 * values loaded as float32), one source for both cache types. */
#define ATTENTION_KV_BF16
#include "attention.c"
