/* paged_attention_kv_bf16: the attention kernels (attention_template.h) over a bfloat16 KV
 * cache, its keys and values loaded as float32. */
#define ATTENTION_KV_BF16
#include "attention_template.h"
