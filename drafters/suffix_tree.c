/* Suffix decoding's index (drafters/suffix.py): token sequences and hashed n-gram tables.
 *
 * A sequence is one request's tokens (prompt, then output). For every position p and every
 * pattern length n of `lens`, the n tokens ending at p are hashed and (sequence id, p) is
 * kept in a bucket of that hash: in the sequence's own table (its prompt and output; private,
 * so that what it finds there depends on its tokens alone), and in the global table for the
 * n-grams that end in an output (recent requests' outputs, shared). A bucket keeps its most
 * recent occurrences (OWN_M, GLOB_M), and every occurrence read is checked against the tokens.
 * The global table has a fixed size, a colliding n-gram taking a bucket over (a cache of the
 * recent outputs). An own table probes OWN_PROBE buckets from an n-gram's home, and grows
 * with its sequence (fourfold, re-indexed, once its inserts exceed its buckets: amortized
 * O(1) per token), so it loses next to nothing; it is freed when the request ends. Memory is the
 * tables plus the tokens of the running and cached sequences; an append costs O(longest
 * pattern) per token whatever the history.
 *
 * A draft (sp_speculate): for each pattern length n, shortest first while the context's last
 * n tokens occur, the continuations after the occurrences are counted into a prefix tree;
 * a node's probability is its parent's times count(node) / count(parent) (1 at the root),
 * and the tree's nodes are taken best first (a node only after its parent), at most
 * `widths[d]` children per node at depth d, none under `min_prob`, at most
 * min(max_nodes, n * max_spec_factor) nodes. The draft with the largest sum of
 * probabilities (the expected accepted tokens) wins, a longer pattern on a tie. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define OWN_M 4
#define GLOB_M 8
#define MAX_LENS 32
#define MAX_OCC (OWN_M + GLOB_M)
#define MAX_DEPTH 64
#define OWN_MIN_BUCKETS 256
#define OWN_PROBE 4  /* own tables: buckets tried from an n-gram's home before it evicts the home one */
#define OWN_MAX_BUCKETS (1 << 20)

typedef struct { uint32_t id; int32_t pos; } Occ;  /* an n-gram ending at `pos` of sequence `id` */
typedef struct { uint32_t check, next; int32_t pos[OWN_M]; } OwnBucket;  /* next == 0: empty */
typedef struct { uint32_t check, next; Occ occ[GLOB_M]; } GlobBucket;

typedef struct {
    int32_t *toks;      /* toks[i]: the token at position base + i */
    int32_t len, cap, base;
    int32_t out_start;  /* the first output position */
    int32_t own_done, glob_done;  /* n-grams ending before these positions are indexed */
    int32_t global;     /* 1: its outputs go into the global table */
    uint32_t id;        /* 0: a free slot */
    OwnBucket *own;     /* its own table (NULL once the request ended) */
    uint64_t own_mask;
    int64_t own_inserts;
} Seq;

typedef struct {
    Seq *seqs;
    int32_t nslots;
    GlobBucket *glob;  /* NULL: no global table */
    uint64_t glob_mask;
    int32_t lens[MAX_LENS], nlens, max_depth;
} Store;

static inline uint64_t mix(uint64_t h, uint64_t t) {  /* MurmurHash3's finalizer over h and t */
    uint64_t x = h * 0x9E3779B97F4A7C15ull + t + 1;
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    return x ^ (x >> 33);
}

static inline int32_t tok(const Seq *s, int32_t p) { return s->toks[p - s->base]; }

static Seq *seq_of(Store *st, uint32_t id) {
    Seq *s = &st->seqs[id % (uint32_t)st->nslots];
    return s->id == id ? s : NULL;
}

Store *sp_create(int32_t nslots, int32_t glob_log2, const int32_t *lens, int32_t nlens, int32_t max_depth) {
    Store *st = calloc(1, sizeof(Store));
    if (!st || nlens > MAX_LENS) return NULL;
    st->nslots = nslots;
    st->seqs = calloc((size_t)nslots, sizeof(Seq));
    if (glob_log2 > 0) {
        st->glob = calloc((size_t)1 << glob_log2, sizeof(GlobBucket));
        st->glob_mask = ((uint64_t)1 << glob_log2) - 1;
    }
    memcpy(st->lens, lens, sizeof(int32_t) * (size_t)nlens);
    st->nlens = nlens;
    st->max_depth = max_depth;
    return st;
}

void sp_destroy(Store *st) {
    for (int32_t i = 0; i < st->nslots; i++) {
        free(st->seqs[i].toks);
        free(st->seqs[i].own);
    }
    free(st->seqs);
    free(st->glob);
    free(st);
}

/* Bytes held: the tables, the slots and the tokens of every sequence. */
int64_t sp_memory(const Store *st) {
    int64_t total = sizeof(Store) + (int64_t)st->nslots * sizeof(Seq);
    if (st->glob) total += (int64_t)(st->glob_mask + 1) * sizeof(GlobBucket);
    for (int32_t i = 0; i < st->nslots; i++) {
        const Seq *s = &st->seqs[i];
        total += (int64_t)s->cap * sizeof(int32_t) + (s->own ? (int64_t)(s->own_mask + 1) * sizeof(OwnBucket) : 0);
    }
    return total;
}

/* Starts sequence `id` (its slot, id % nslots, must be free): output from `out_start`. */
int32_t sp_open(Store *st, uint32_t id, int32_t out_start, int32_t global) {
    Seq *s = &st->seqs[id % (uint32_t)st->nslots];
    if (s->id != 0 || id == 0) return -1;
    memset(s, 0, sizeof(Seq));
    s->id = id;
    s->out_start = out_start;
    s->global = global && st->glob != NULL;
    s->own = calloc(OWN_MIN_BUCKETS, sizeof(OwnBucket));
    s->own_mask = OWN_MIN_BUCKETS - 1;
    return s->own ? 0 : -2;
}

/* The own-table bucket of `key`: its own, else (create) an empty one within OWN_PROBE of its
 * home, else the home bucket emptied for it; NULL when absent and not created. */
static OwnBucket *own_bucket(Seq *s, uint64_t key, int create) {
    uint32_t check = (uint32_t)(key >> 32);
    for (uint64_t i = 0; i < OWN_PROBE; i++) {
        OwnBucket *b = &s->own[(key + i) & s->own_mask];
        if (b->next && b->check == check) return b;
        if (!b->next) {
            if (!create) return NULL;
            b->check = check;
            return b;
        }
    }
    if (!create) return NULL;
    OwnBucket *b = &s->own[key & s->own_mask];
    b->check = check;
    b->next = 0;
    return b;
}

static void insert(uint32_t *check_p, uint32_t *next_p, Occ *occ, int m, uint32_t check, uint32_t id, int32_t pos) {
    if (*check_p != check) {
        *check_p = check;
        *next_p = 0;
        memset(occ, 0, sizeof(Occ) * (size_t)m);
    }
    occ[*next_p % (uint32_t)m] = (Occ){id, pos};
    (*next_p)++;
}

/* Indexes the n-grams ending at positions [from, to) into s's own table (which = 0) or the
 * global one (1). */
static void index_range(Store *st, Seq *s, int32_t from, int32_t to, int which) {
    uint64_t salt = which ? 0 : 0x51ED270B27A4F6D1ull;
    int32_t longest = st->lens[st->nlens - 1];
    for (int32_t p = from; p < to; p++) {
        uint64_t h = 0;
        int li = 0;
        for (int32_t n = 1; n <= longest && p - n + 1 >= s->base; n++) {
            h = mix(h, (uint32_t)tok(s, p - n + 1));
            if (n != st->lens[li]) continue;
            li++;
            uint64_t key = mix(h, salt);
            uint32_t check = (uint32_t)(key >> 32);
            if (which) {
                GlobBucket *b = &st->glob[key & st->glob_mask];
                insert(&b->check, &b->next, b->occ, GLOB_M, check, s->id, p);
            } else {
                OwnBucket *b = own_bucket(s, key, 1);
                b->pos[b->next++ % OWN_M] = p;
                s->own_inserts++;
            }
        }
    }
}

/* Four times the buckets, every n-gram indexed again (the table's content stays a function
 * of the sequence's tokens alone). */
static void grow_own(Store *st, Seq *s) {
    uint64_t buckets = (s->own_mask + 1) * 4;
    OwnBucket *own = calloc(buckets, sizeof(OwnBucket));
    if (!own) return;  /* keep the smaller table */
    free(s->own);
    s->own = own;
    s->own_mask = buckets - 1;
    s->own_inserts = 0;
    index_range(st, s, s->base, s->own_done, 0);
}

/* Appends `n` tokens to sequence `id` and indexes every n-gram that now has a continuation. */
int32_t sp_append(Store *st, uint32_t id, const int32_t *toks, int32_t n) {
    Seq *s = seq_of(st, id);
    if (!s) return -1;
    if (s->len - s->base + n > s->cap) {
        int32_t cap = s->cap ? s->cap : 64;
        while (cap < s->len - s->base + n) cap *= 2;
        int32_t *grown = realloc(s->toks, sizeof(int32_t) * (size_t)cap);
        if (!grown) return -2;
        s->toks = grown;
        s->cap = cap;
    }
    memcpy(s->toks + (s->len - s->base), toks, sizeof(int32_t) * (size_t)n);
    s->len += n;
    if (s->own) {
        index_range(st, s, s->own_done, s->len - 1, 0);
        s->own_done = s->len - 1 > s->own_done ? s->len - 1 : s->own_done;
        if (s->own_inserts > (int64_t)(s->own_mask + 1) && s->own_mask + 1 < OWN_MAX_BUCKETS) grow_own(st, s);
    }
    if (s->global) {
        int32_t from = s->glob_done > s->out_start - 1 ? s->glob_done : s->out_start - 1;
        if (from < s->base) from = s->base;
        index_range(st, s, from, s->len - 1, 1);
        s->glob_done = s->len - 1;
    }
    return 0;
}

/* Cuts sequence `id` back to `len` tokens (occurrences past it fail their check). */
int32_t sp_truncate(Store *st, uint32_t id, int32_t len) {
    Seq *s = seq_of(st, id);
    if (!s || len < s->base) return -1;
    if (len < s->len) s->len = len;
    if (s->own_done > s->len - 1) s->own_done = s->len - 1 > 0 ? s->len - 1 : 0;
    if (s->glob_done > s->len - 1) s->glob_done = s->len - 1 > 0 ? s->len - 1 : 0;
    return 0;
}

/* The request ended: keep its output (and the `keep_before` tokens before it) for the global
 * table, or free the sequence (keep = 0). */
void sp_close(Store *st, uint32_t id, int32_t keep, int32_t keep_before) {
    Seq *s = seq_of(st, id);
    if (!s) return;
    free(s->own);
    s->own = NULL;
    if (!keep || !s->global) {
        free(s->toks);
        memset(s, 0, sizeof(Seq));
        return;
    }
    int32_t base = s->out_start - keep_before;
    if (base > s->base) {
        memmove(s->toks, s->toks + (base - s->base), sizeof(int32_t) * (size_t)(s->len - base));
        s->base = base;
        int32_t *kept = realloc(s->toks, sizeof(int32_t) * (size_t)(s->len - base + 1));
        if (kept) {
            s->toks = kept;
            s->cap = s->len - base + 1;
        }
    }
}

typedef struct { const Seq *s; int32_t pos; } Hit;

static int same(const Seq *a, int32_t pa, const Seq *b, int32_t pb, int32_t n) {
    for (int32_t j = 0; j < n; j++)
        if (tok(a, pa - j) != tok(b, pb - j)) return 0;
    return 1;
}

/* The occurrences, other than the context's own end, of the last n tokens of `s` (hash `h`). */
static int lookup(Store *st, const Seq *s, int32_t n, uint64_t h, int use_glob, Hit *hits) {
    int k = 0;
    int32_t end = s->len - 1;
    uint64_t key = mix(h, 0x51ED270B27A4F6D1ull);
    OwnBucket *ob = s->own ? own_bucket((Seq *)s, key, 0) : NULL;
    if (ob) {
        for (uint32_t i = 0; i < ob->next && i < OWN_M; i++) {
            int32_t pos = ob->pos[(ob->next - 1 - i) % OWN_M];  /* most recent first */
            if (pos < end && pos - n + 1 >= s->base && same(s, pos, s, end, n)) hits[k++] = (Hit){s, pos};
        }
    }
    if (!use_glob || !st->glob) return k;
    key = mix(h, 0);
    GlobBucket *gb = &st->glob[key & st->glob_mask];
    if (gb->check != (uint32_t)(key >> 32)) return k;
    for (uint32_t i = 0; i < gb->next && i < GLOB_M; i++) {
        Occ o = gb->occ[(gb->next - 1 - i) % GLOB_M];
        const Seq *t = o.id == s->id ? NULL : seq_of(st, o.id);
        if (t && o.pos < t->len - 1 && o.pos - n + 1 >= t->base && same(t, o.pos, s, end, n))
            hits[k++] = (Hit){t, o.pos};
    }
    return k;
}

typedef struct { int32_t token, count, first, next; } TNode;  /* a prefix tree of continuations */

static int count_tree(const Hit *hits, int nh, int32_t depth, TNode *nodes) {
    int nn = 1;
    nodes[0] = (TNode){-1, 0, -1, -1};
    for (int i = 0; i < nh; i++) {
        const Seq *t = hits[i].s;
        int cur = 0;
        for (int32_t d = 0; d < depth && hits[i].pos + 1 + d < t->len; d++) {
            int32_t token = tok(t, hits[i].pos + 1 + d);
            int c = nodes[cur].first;
            while (c >= 0 && nodes[c].token != token) c = nodes[c].next;
            if (c < 0) {
                c = nn++;
                nodes[c] = (TNode){token, 0, -1, nodes[cur].first};
                nodes[cur].first = c;
            }
            if (d == 0) nodes[0].count++;
            nodes[c].count++;
            cur = c;
        }
    }
    return nn;
}

typedef struct { float prob; int32_t node, parent, depth; } Item;

static int better(const Item *a, const Item *b) { return a->prob > b->prob; }

static void heap_push(Item *h, int *n, Item it) {
    int i = (*n)++;
    while (i > 0 && better(&it, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = it;
}

static Item heap_pop(Item *h, int *n) {
    Item top = h[0], last = h[--(*n)];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && better(&h[c + 1], &h[c])) c++;
        if (!better(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = last;
    return top;
}

/* Best-first selection from the counted tree (see the header); returns the number of nodes. */
static int select_tree(const TNode *nodes, int32_t max_nodes, const int32_t *widths, int32_t nwidths,
                       float min_prob, int32_t *out_tok, int32_t *out_par, float *out_prob, float *score) {
    Item heap[MAX_OCC * MAX_DEPTH + 1];
    int32_t nkids[MAX_DEPTH * 4 + 1];  /* children taken per drafted node (index + 1; 0: root) */
    int nheap = 0, n = 0;
    *score = 0;
    for (int c = nodes[0].first; c >= 0; c = nodes[c].next)
        heap_push(heap, &nheap, (Item){(float)nodes[c].count / (float)nodes[0].count, c, -1, 0});
    nkids[0] = 0;
    while (nheap && n < max_nodes) {
        Item it = heap_pop(heap, &nheap);
        if (it.prob < min_prob) break;  /* every other item is as unlikely */
        if (it.depth >= nwidths || nkids[it.parent + 1] >= widths[it.depth]) continue;
        nkids[it.parent + 1]++;
        out_tok[n] = nodes[it.node].token;
        out_par[n] = it.parent;
        out_prob[n] = it.prob;
        *score += it.prob;
        nkids[n + 1] = 0;
        for (int c = nodes[it.node].first; c >= 0 && nheap < MAX_OCC * MAX_DEPTH; c = nodes[c].next)
            heap_push(heap, &nheap,
                      (Item){it.prob * (float)nodes[c].count / (float)nodes[it.node].count, c, n, it.depth + 1});
        n++;
    }
    return n;
}

/* The draft for sequence `id` (see the header): its nodes' tokens, parents (-1: the root) and
 * probabilities in the out arrays (room for max_nodes); returns the node count, and the
 * pattern length it came from in *match_len (0: no draft). widths: nwidths <= MAX_DEPTH. */
int32_t sp_speculate(Store *st, uint32_t id, int32_t use_glob, int32_t max_nodes, const int32_t *widths,
                     int32_t nwidths, float max_spec_factor, float min_prob, int32_t *out_tok, int32_t *out_par,
                     float *out_prob, int32_t *match_len) {
    Seq *s = seq_of(st, id);
    *match_len = 0;
    if (!s || s->len < 2 || max_nodes > MAX_DEPTH * 4) return 0;
    Hit hits[MAX_OCC];
    TNode nodes[MAX_OCC * MAX_DEPTH + 1];
    int32_t tok_buf[MAX_DEPTH * 4], par_buf[MAX_DEPTH * 4];
    float prob_buf[MAX_DEPTH * 4], best_score = -1, score;
    int32_t best_n = 0;
    uint64_t h = 0;
    int li = 0;
    if (nwidths > MAX_DEPTH) nwidths = MAX_DEPTH;
    for (int32_t n = 1; n <= s->len - s->base && li < st->nlens; n++) {
        h = mix(h, (uint32_t)tok(s, s->len - n));
        if (n != st->lens[li]) continue;
        li++;
        int nh = lookup(st, s, n, h, use_glob, hits);
        if (nh == 0) break;  /* a longer pattern would not occur either */
        int32_t budget = (int32_t)(n * max_spec_factor + 1e-6f);
        budget = budget < max_nodes ? budget : max_nodes;
        int32_t depth = st->max_depth - n < nwidths ? st->max_depth - n : nwidths;
        depth = depth < budget ? depth : budget;  /* a deeper node could not be taken */
        if (budget <= 0 || depth <= 0) continue;
        count_tree(hits, nh, depth, nodes);
        int32_t k = select_tree(nodes, budget, widths, depth, min_prob, tok_buf, par_buf, prob_buf, &score);
        if (k > 0 && score >= best_score) {
            best_score = score;
            best_n = k;
            *match_len = n;
            memcpy(out_tok, tok_buf, sizeof(int32_t) * (size_t)k);
            memcpy(out_par, par_buf, sizeof(int32_t) * (size_t)k);
            memcpy(out_prob, prob_buf, sizeof(float) * (size_t)k);
        }
    }
    return best_n;
}

/* The longest pattern length whose last-n tokens of sequence `id` occur (0: none). */
int32_t sp_match(Store *st, uint32_t id, int32_t use_glob) {
    Seq *s = seq_of(st, id);
    if (!s || s->len < 2) return 0;
    Hit hits[MAX_OCC];
    uint64_t h = 0;
    int li = 0;
    int32_t best = 0;
    for (int32_t n = 1; n <= s->len - s->base && li < st->nlens; n++) {
        h = mix(h, (uint32_t)tok(s, s->len - n));
        if (n != st->lens[li]) continue;
        li++;
        if (lookup(st, s, n, h, use_glob, hits) == 0) break;
        best = n;
    }
    return best;
}
