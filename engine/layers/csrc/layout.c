/* The layouts of specserve_kernels.h's structs as this compiler lays them out, for the tests
 * that check each ctypes twin on the Python side against them. */
#include <stddef.h>
#include <string.h>

#include "specserve_kernels.h"

#define FIELD(S, f) {#S, #f, offsetof(S, f)}
#define SIZE(S) {#S, NULL, sizeof(S)}

static const struct {
    const char *name, *field;
    size_t offset;
} LAYOUT[] = {
    SIZE(layer_t), FIELD(layer_t, hidden), FIELD(layer_t, heads), FIELD(layer_t, kv_heads),
    FIELD(layer_t, head_dim), FIELD(layer_t, inter), FIELD(layer_t, eps), FIELD(layer_t, scale),
    FIELD(layer_t, ln1), FIELD(layer_t, ln2), FIELD(layer_t, w_qkv), FIELD(layer_t, w_o), FIELD(layer_t, w_gu),
    FIELD(layer_t, w_down), FIELD(layer_t, b_qkv), FIELD(layer_t, q_norm), FIELD(layer_t, k_norm),
    FIELD(layer_t, mm), FIELD(layer_t, moe),
    SIZE(step_t), FIELD(step_t, cos), FIELD(step_t, sin), FIELD(step_t, slot_mapping), FIELD(step_t, rows),
    FIELD(step_t, start), FIELD(step_t, len), FIELD(step_t, slots), FIELD(step_t, scratch),
    SIZE(moe_t), FIELD(moe_t, experts), FIELD(moe_t, top_k), FIELD(moe_t, inter), FIELD(moe_t, normalize),
    FIELD(moe_t, shared_inter), FIELD(moe_t, router), FIELD(moe_t, gate_up), FIELD(moe_t, down),
    FIELD(moe_t, shared_gate), FIELD(moe_t, shared_gate_up), FIELD(moe_t, shared_down),
    SIZE(quant_matrix), FIELD(quant_matrix, parts), FIELD(quant_matrix, fmts), FIELD(quant_matrix, ws),
    FIELD(quant_matrix, ns),
};

int64_t kernel_struct_offset(const char *name, const char *field) {
    for (size_t i = 0; i < sizeof LAYOUT / sizeof LAYOUT[0]; i++)
        if (!strcmp(LAYOUT[i].name, name) && (field ? LAYOUT[i].field && !strcmp(LAYOUT[i].field, field)
                                                    : !LAYOUT[i].field))
            return (int64_t)LAYOUT[i].offset;
    return -1;
}
