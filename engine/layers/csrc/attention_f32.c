/* paged_attention_f32: the attention kernels (attention_template.h) over a float32 KV cache. */
#include "attention_template.h"
