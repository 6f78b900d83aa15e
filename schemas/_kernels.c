/* Native passes over a trajectory batch, read through the Arrow C data interface (one export per batch).
 *
 * check_group_batch: whether a batch of the trajectory schema's columns and types (its schema's signature)
 * keeps every rule of the common case (no nulls or validity bitmaps, one group_id, sample_idx 0..n-1 once
 * each, a known status, finite rewards, loss masks 0/1 and loss_tokens their sum, num_turns >= 1, versions >= 0
 * and min <= max, list lengths that agree, token_versions within each row's versions), filling the `bytes` column
 * on the way. It answers only
 * "all kept" (0, or -1 when the columns' own fields differ from the schema's) or "look closer" (a reason
 * code > 0): the Python rules in schemas/trajectory_rules.py stay the one place that names what is wrong,
 * and run on any batch this pass does not accept. It never accepts a batch they would refuse.
 *
 * row_bytes: payload bytes of each row and column (fixed width, or a 4-byte offset plus values).
 *
 * Both read only offsets and values the caller's RecordBatch.validate(full=True) proved in bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct ArrowArray {
    int64_t length;
    int64_t null_count;
    int64_t offset;
    int64_t n_buffers;
    int64_t n_children;
    const void **buffers;
    struct ArrowArray **children;
    struct ArrowArray *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};

struct ArrowSchema {
    const char *format;
    const char *name;
    const char *metadata;
    int64_t flags;
    int64_t n_children;
    struct ArrowSchema **children;
    struct ArrowSchema *dictionary;
    void (*release)(struct ArrowSchema *);
    void *private_data;
};

/* The types of a schema's columns, as one string: each column's name and format, with its children (a list's
 * values: name, nullability, format) in parentheses, every name and format prefixed with its length; equal
 * signatures = columns of the same names and types (a column's own nullability and metadata aside: the checks
 * read null counts, and the caller rebuilds the batch under the schema itself). */
#define SIGNATURE_MAX 4096
#define ARROW_FLAG_NULLABLE 2

static int append_bytes(char *buf, size_t *len, const char *s, size_t n) {
    if (*len + n >= SIGNATURE_MAX)
        return 0;
    if (n > 0)
        memcpy(buf + *len, s, n);
    *len += n;
    return 1;
}

static int append(char *buf, size_t *len, const char *punctuation) {
    return append_bytes(buf, len, punctuation, strlen(punctuation));
}

/* A name, format or metadata a writer chose, prefixed with its length: no choice of them reads as another. */
static int append_field(char *buf, size_t *len, const char *s, size_t n) {
    char prefix[24];  /* n in decimal, then a quote (by hand: this runs for every field of every batch) */
    size_t k = sizeof prefix, rest = n;
    prefix[--k] = '\'';
    do {
        prefix[--k] = (char)('0' + rest % 10);
        rest /= 10;
    } while (rest > 0);
    return append_bytes(buf, len, prefix + k, sizeof prefix - k) && append_bytes(buf, len, s, n);
}

static int type_signature(const struct ArrowSchema *t, char *buf, size_t *len) {
    if (t == NULL || t->format == NULL || !append_field(buf, len, t->format, strlen(t->format)) ||
        (t->dictionary != NULL && !append(buf, len, "!dictionary")))
        return 0;
    for (int64_t k = 0; k < t->n_children; k++) {  /* a nested field's name and nullability are part of the type */
        const struct ArrowSchema *c = t->children[k];
        if (c == NULL || c->name == NULL || !append(buf, len, "(") ||
            !append_field(buf, len, c->name, strlen(c->name)) ||
            !append(buf, len, (c->flags & ARROW_FLAG_NULLABLE) ? "?" : "!") || !type_signature(c, buf, len) ||
            !append(buf, len, ")"))
            return 0;
    }
    return 1;
}

/* The bytes of a field's metadata as the C data interface encodes it (int32 count, then int32-length-prefixed
 * keys and values). */
static size_t metadata_size(const char *m) {
    if (m == NULL)
        return 0;
    int32_t n, k;
    size_t at = sizeof n;
    memcpy(&n, m, sizeof n);
    for (int32_t i = 0; i < 2 * n; i++) {
        memcpy(&k, m + at, sizeof k);
        at += sizeof k + (size_t)k;
    }
    return at;
}

/* `fields`: each column's own nullability and metadata too (equal = the very same fields). */
static int signature(const struct ArrowSchema *schema, int fields, char *buf, size_t *len) {
    *len = 0;
    if (schema == NULL || schema->format == NULL || strcmp(schema->format, "+s") != 0)
        return 0;
    for (int64_t j = 0; j < schema->n_children; j++) {
        const struct ArrowSchema *c = schema->children[j];
        if (c == NULL || c->name == NULL || !append_field(buf, len, c->name, strlen(c->name)) ||
            !append(buf, len, ":") || !type_signature(c, buf, len))
            return 0;
        if (fields && (!append(buf, len, (c->flags & ARROW_FLAG_NULLABLE) ? "?" : "!") ||
                       !append_field(buf, len, c->metadata, metadata_size(c->metadata))))
            return 0;
        if (!append(buf, len, ";"))
            return 0;
    }
    return 1;
}

static const struct ArrowSchema *schema_of(PyObject *capsule) {
    const struct ArrowSchema *schema = PyCapsule_GetPointer(capsule, "arrow_schema");
    if (schema == NULL)
        PyErr_Clear();
    return schema;
}

/* Whether `schema` has the signature `want` (of its columns' types, or with `fields`, of the fields too). */
static int signed_as(const struct ArrowSchema *schema, int fields, const Py_buffer *want) {
    char buf[SIGNATURE_MAX];
    size_t len;
    return schema != NULL && signature(schema, fields, buf, &len) && (Py_ssize_t)len == want->len &&
           memcmp(buf, want->buf, len) == 0;
}

static PyObject *schema_signature(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int fields = 0;
    if (!PyArg_ParseTuple(args, "O|p", &capsule, &fields))
        return NULL;
    const struct ArrowSchema *schema = PyCapsule_GetPointer(capsule, "arrow_schema");
    char buf[SIGNATURE_MAX];
    size_t len;
    if (schema == NULL)
        return NULL;
    if (!signature(schema, fields, buf, &len)) {
        PyErr_SetString(PyExc_ValueError, "signature: not a schema of named columns, or too long");
        return NULL;
    }
    return PyBytes_FromStringAndSize(buf, (Py_ssize_t)len);
}

/* The roles check_group_batch reads, in the order of the `roles` table the caller passes (column indexes). */
enum {
    R_GROUP_ID, R_SAMPLE_IDX, R_VERSION, R_VERSION_MIN, R_PROMPT_LEN, R_RESPONSE_LEN, R_REWARD, R_STATUS,
    R_NUM_IMAGES, R_NUM_TURNS, R_LOSS_TOKENS, R_PROMPT_IDS, R_RESPONSE_IDS, R_RESPONSE_LOGPROBS, R_LOSS_MASK, R_IMAGE_KEYS, N_ROLES
};
/* The payload (list) columns, in role order from R_PROMPT_IDS: `bytes` counts their values. */
#define N_LISTS 5

/* Reasons a batch goes to the Python rules (never shown to a writer: the Python rules name the error); their
 * numbers are schemas/native.py's STEPS_ASIDE and RULE_COLUMNS. */
enum {
    OK, SCHEMA, NOT_A_BATCH, NULLS, GROUP_ID, SAMPLE_IDX, STATUS, REWARD, LOSS_MASK, VERSION, LENGTHS, TOKEN_VERSIONS,
    TURNS
};

static struct ArrowArray *batch_of(PyObject *capsule) {
    struct ArrowArray *batch = PyCapsule_GetPointer(capsule, "arrow_array");
    if (batch == NULL)
        PyErr_Clear();
    return batch;
}

/* The offsets of a string, binary or list column (32-bit) from row `row0`: value i spans [o[i], o[i + 1]). */
static inline const int32_t *offsets_of(const struct ArrowArray *col, int64_t row0) {
    return (const int32_t *)col->buffers[1] + col->offset + row0;
}

static inline const void *values_of(const struct ArrowArray *col, int64_t row0, size_t width) {
    return (const char *)col->buffers[1] + (col->offset + row0) * width;
}

/* No null anywhere and no validity bitmap to strip, in a column and (for a list) its values; its data (or
 * offsets) buffer present. */
static int without_nulls(const struct ArrowArray *col, int is_list) {
    if (col->null_count != 0 || col->n_buffers < 2 || col->buffers[0] != NULL || col->buffers[1] == NULL)
        return 0;
    if (is_list) {
        const struct ArrowArray *v = col->n_children == 1 ? col->children[0] : NULL;
        if (v == NULL || v->null_count != 0 || v->n_buffers < 2 || v->buffers[0] != NULL)
            return 0;
    }
    return 1;
}

/* Whether each of the `n` values of a string column is one of the NUL-separated strings of `set` (`set_len`
 * bytes in all, the last one unterminated). */
static int all_in(const struct ArrowArray *col, int64_t n, const char *set, Py_ssize_t set_len) {
    const int32_t *o = offsets_of(col, 0);
    const char *data = (const char *)col->buffers[2];
    for (int64_t i = 0; i < n; i++) {
        const size_t len = (size_t)(o[i + 1] - o[i]);
        int found = 0;
        for (const char *s = set; !found && s < set + set_len;) {
            const char *end = memchr(s, 0, (size_t)(set + set_len - s));
            const size_t k = end == NULL ? (size_t)(set + set_len - s) : (size_t)(end - s);
            found = k == len && memcmp(data + o[i], s, len) == 0;
            s += k + 1;
        }
        if (!found)
            return 0;
    }
    return 1;
}

/* Whether each of the `n` values of a string column equals `s` (`len` bytes). */
static int all_equal(const struct ArrowArray *col, int64_t n, const char *s, Py_ssize_t len) {
    const int32_t *o = offsets_of(col, 0);
    const char *data = (const char *)col->buffers[2];
    for (int64_t i = 0; i < n; i++)
        if (o[i + 1] - o[i] != len || memcmp(data + o[i], s, (size_t)len) != 0)
            return 0;
    return 1;
}

/* Whether each row's token_versions (list<int32> column `tv`, no nulls) holds one version per response token
 * (`ro`: response_ids' offsets), each within the row's [vmin, v]. */
static int token_versions_kept(const struct ArrowArray *tv, int64_t n, const int32_t *ro, const int64_t *v,
                               const int64_t *vmin) {
    const int32_t *to = offsets_of(tv, 0);
    const struct ArrowArray *values = tv->children[0];
    const int32_t *x = (const int32_t *)values->buffers[1] + values->offset;
    for (int64_t i = 0; i < n; i++) {
        if (to[i + 1] - to[i] != ro[i + 1] - ro[i])
            return 0;
        for (int64_t k = to[i]; k < to[i + 1]; k++)
            if (x[k] < vmin[i] || x[k] > v[i])
                return 0;
    }
    return 1;
}

static int check(const struct ArrowArray *batch, const int32_t *roles, const int32_t *widths, int64_t ncols,
                 int32_t tv_index, const char *gid, Py_ssize_t gid_len, const char *statuses, Py_ssize_t statuses_len,
                 int64_t *bytes) {
    const int64_t n = batch->length;
    if (batch->n_children != ncols || batch->offset != 0 || n <= 0)
        return NOT_A_BATCH;
    const struct ArrowArray *c[N_ROLES];
    for (int r = 0; r < N_ROLES; r++) {
        if (roles[r] < 0 || roles[r] >= ncols)
            return NOT_A_BATCH;
        c[r] = batch->children[roles[r]];
        if (c[r]->length != n)
            return NOT_A_BATCH;
    }
    for (int64_t j = 0; j < ncols; j++) {
        const struct ArrowArray *col = batch->children[j];
        if (col->length != n || !without_nulls(col, col->n_children == 1))
            return NULLS;
    }
    const int lists[N_LISTS] = {R_PROMPT_IDS, R_RESPONSE_IDS, R_RESPONSE_LOGPROBS, R_LOSS_MASK, R_IMAGE_KEYS};
    for (int k = 0; k < N_LISTS; k++)
        if (!without_nulls(c[lists[k]], 1))
            return NULLS;
    const int strings[] = {R_GROUP_ID, R_STATUS};
    for (size_t k = 0; k < sizeof strings / sizeof strings[0]; k++)
        if (c[strings[k]]->n_buffers < 3 || c[strings[k]]->buffers[2] == NULL)
            return NULLS;

    /* one group: every group_id is the descriptor's */
    if (!all_equal(c[R_GROUP_ID], n, gid, gid_len))
        return GROUP_ID;

    /* sample_idx: 0..n-1, each once */
    const int32_t *idx = values_of(c[R_SAMPLE_IDX], 0, 4);
    unsigned char *seen = calloc((size_t)n, 1);
    if (seen == NULL)
        return NOT_A_BATCH;
    int bad = 0;
    for (int64_t i = 0; i < n && !bad; i++) {
        if (idx[i] < 0 || idx[i] >= n || seen[idx[i]])
            bad = 1;
        else
            seen[idx[i]] = 1;
    }
    free(seen);
    if (bad)
        return SAMPLE_IDX;

    if (!all_in(c[R_STATUS], n, statuses, statuses_len))
        return STATUS;

    const float *reward = values_of(c[R_REWARD], 0, 4);
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(reward[i]))
            return REWARD;

    const int64_t *v = values_of(c[R_VERSION], 0, 8), *vmin = values_of(c[R_VERSION_MIN], 0, 8);
    for (int64_t i = 0; i < n; i++)
        if (v[i] < 0 || vmin[i] < 0 || vmin[i] > v[i])
            return VERSION;

    const int32_t *po = offsets_of(c[R_PROMPT_IDS], 0), *ro = offsets_of(c[R_RESPONSE_IDS], 0);
    const int32_t *lo = offsets_of(c[R_RESPONSE_LOGPROBS], 0), *mo = offsets_of(c[R_LOSS_MASK], 0);
    const int32_t *io = offsets_of(c[R_IMAGE_KEYS], 0);
    const int32_t *plen = values_of(c[R_PROMPT_LEN], 0, 4), *rlen = values_of(c[R_RESPONSE_LEN], 0, 4);
    const int16_t *nimg = values_of(c[R_NUM_IMAGES], 0, 2);
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = po[i + 1] - po[i], r = ro[i + 1] - ro[i], im = io[i + 1] - io[i];
        if (lo[i + 1] - lo[i] != r || mo[i + 1] - mo[i] != r || rlen[i] != r || plen[i] != p || nimg[i] != im)
            return LENGTHS;
        /* the payload: each list's values times their width, plus one 4-byte offset per list; and token_versions
         * (sent or to be filled): an offset and one int32 per response token */
        bytes[i] = N_LISTS * 4 + p * widths[0] + r * (widths[1] + widths[2] + widths[3]) + im * widths[4] + 4 + 4 * r;
    }

    const struct ArrowArray *mask = c[R_LOSS_MASK]->children[0];
    const uint8_t *m = (const uint8_t *)mask->buffers[1] + mask->offset;
    /* every value 0 or 1 = no bit above the lowest in any: one OR over all, eight values at a time */
    uint64_t bits = 0, word;
    int64_t k = mo[0];
    for (; k + 8 <= mo[n]; k += 8) {
        memcpy(&word, m + k, sizeof word);
        bits |= word;
    }
    for (; k < mo[n]; k++)
        bits |= m[k];
    if (bits & ~UINT64_C(0x0101010101010101))
        return LOSS_MASK;
    /* loss_tokens: each row's count of trained tokens, the sum of its mask */
    const int32_t *ltok = values_of(c[R_LOSS_TOKENS], 0, 4);
    for (int64_t i = 0; i < n; i++) {
        int64_t ones = 0;
        for (int64_t j = mo[i]; j < mo[i + 1]; j++)
            ones += m[j];
        if (ltok[i] != ones)
            return LOSS_MASK;
    }
    const int16_t *turns = values_of(c[R_NUM_TURNS], 0, 2);
    for (int64_t i = 0; i < n; i++)
        if (turns[i] < 1)
            return TURNS;
    if (tv_index >= 0 && (tv_index >= ncols || batch->children[tv_index]->n_children != 1 ||
                          !token_versions_kept(batch->children[tv_index], n, ro, v, vmin)))
        return TOKEN_VERSIONS;
    return OK;
}

static PyObject *check_group_batch(PyObject *self, PyObject *args) {
    PyObject *schema_capsule, *capsule;
    const char *gid, *statuses;
    Py_ssize_t gid_len, statuses_len;
    Py_buffer sig, exact, table, out;
    if (!PyArg_ParseTuple(args, "OOy*y*y#y#y*w*", &schema_capsule, &capsule, &sig, &exact, &gid, &gid_len, &statuses,
                          &statuses_len, &table, &out))
        return NULL;
    struct ArrowArray *batch = batch_of(capsule);
    const struct ArrowSchema *schema = schema_of(schema_capsule);
    const int same_fields = signed_as(schema, 1, &exact);
    int code = same_fields || signed_as(schema, 0, &sig) ? NOT_A_BATCH : SCHEMA;
    if (code == NOT_A_BATCH && batch != NULL && table.len == (2 + N_ROLES + N_LISTS) * (Py_ssize_t)sizeof(int32_t) &&
        out.len == batch->length * (Py_ssize_t)sizeof(int64_t)) {
        /* the column count, one index per role, the value width of each payload list, then token_versions'
         * index (-1: the batch leaves it out) */
        const int32_t *t = table.buf;
        code = check(batch, t + 1, t + 1 + N_ROLES, t[0], t[1 + N_ROLES + N_LISTS], gid, gid_len, statuses,
                     statuses_len, out.buf);
    }
    PyBuffer_Release(&sig);
    PyBuffer_Release(&exact);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    return PyLong_FromLong(code == OK && !same_fields ? -1 : code);
}

static PyObject *row_bytes(PyObject *self, PyObject *args) {
    PyObject *schema_capsule, *capsule;
    Py_buffer sig, layout, out;
    if (!PyArg_ParseTuple(args, "OOy*y*w*", &schema_capsule, &capsule, &sig, &layout, &out))
        return NULL;
    const struct ArrowSchema *schema = schema_of(schema_capsule);
    struct ArrowArray *batch = batch_of(capsule);
    const int32_t *widths = layout.buf;  /* per column: the fixed width, or -(value width) - 1 for offsets */
    const int64_t ncols = layout.len / (Py_ssize_t)sizeof(int32_t);
    int ok = signed_as(schema, 0, &sig) && batch != NULL && batch->n_children == ncols && batch->offset == 0 &&
             out.len == batch->length * ncols * (Py_ssize_t)sizeof(int32_t);
    for (int64_t j = 0; ok && j < ncols; j++) {
        const struct ArrowArray *col = batch->children[j];
        ok = col->length == batch->length && (widths[j] >= 0 || (col->n_buffers >= 2 && col->buffers[1] != NULL));
    }
    if (ok) {
        int32_t *o = out.buf;
        const int64_t n = batch->length;
        for (int64_t j = 0; j < ncols; j++) {
            if (widths[j] >= 0) {
                for (int64_t i = 0; i < n; i++)
                    o[i * ncols + j] = widths[j];
            } else {
                const int32_t *off = offsets_of(batch->children[j], 0);
                const int32_t w = -widths[j] - 1;
                for (int64_t i = 0; i < n; i++)
                    o[i * ncols + j] = 4 + (off[i + 1] - off[i]) * w;
            }
        }
    }
    PyBuffer_Release(&sig);
    PyBuffer_Release(&layout);
    PyBuffer_Release(&out);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "row_bytes: the batch is not of the schema signed, or out is not its size");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"signature", schema_signature, METH_VARARGS,
     "signature(schema_capsule, fields=False) -> bytes: the names and types of the schema's columns (with fields, "
     "their nullability and metadata too), as the checks compare them"},
    {"check_group_batch", check_group_batch, METH_VARARGS,
     "check_group_batch(schema_capsule, array_capsule, signature, fields_signature, group_id, statuses, table, "
     "out_bytes) -> 0 when the batch has the signature and every rule of the common case holds (out_bytes filled, "
     "token_versions counted whether sent or to be filled), "
     "-1 the same with fields of another signature, else a reason > 0"},
    {"row_bytes", row_bytes, METH_VARARGS,
     "row_bytes(schema_capsule, array_capsule, signature, layout, out): payload bytes of each row and column into "
     "out (int32, rows x columns) of a batch with the signature"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
