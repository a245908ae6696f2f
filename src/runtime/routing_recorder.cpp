#include "runtime/routing_recorder.h"

#include "ggml-backend.h"

#include <cstring>

namespace hybrimoe {

namespace {

constexpr const char * kTopk = "ffn_moe_topk-";
constexpr const char * kProbs = "ffn_moe_probs-";

}  // namespace

int layer_of_node(const char * name, const char * prefix) {
    const size_t n = std::strlen(prefix);
    if (std::strncmp(name, prefix, n) != 0) return -1;
    const char * p = name + n;
    if (*p == '\0') return -1;
    int il = 0;
    for (; *p; ++p) {
        if (*p < '0' || *p > '9' || il > 1000000) return -1;
        il = il * 10 + (*p - '0');
    }
    return il;
}

bool RoutingRecorder::callback(ggml_tensor * t, bool ask, void * user_data) {
    auto * self = static_cast<RoutingRecorder *>(user_data);
    if (!self->enabled_ || t == nullptr) return ask ? false : true;
    const char * name = t->name;
    if (std::strncmp(name, "ffn_moe_", 8) != 0) return ask ? false : true;
    int il = layer_of_node(name, kTopk);
    const bool is_ids = il >= 0;
    if (!is_ids) il = layer_of_node(name, kProbs);
    if (ask) return il >= 0;
    if (il >= 0) self->copy(t, is_ids, il);
    return true;  // never stop the computation
}

void RoutingRecorder::copy(ggml_tensor * t, bool is_ids, int il) {
    const ggml_type want = is_ids ? GGML_TYPE_I32 : GGML_TYPE_F32;
    if (t->type != want || t->nb[0] != ggml_type_size(want) || t->ne[2] != 1 || t->ne[3] != 1) {
        if (error_.empty()) {
            error_ = std::string("node ") + t->name + " has type " + ggml_type_name(t->type) +
                     " and shape [" + std::to_string(t->ne[0]) + ", " + std::to_string(t->ne[1]) + ", " +
                     std::to_string(t->ne[2]) + "]; expected " + ggml_type_name(want) + " [n, tokens]";
        }
        return;
    }
    if ((size_t) il >= layers_.size()) layers_.resize((size_t) il + 1);
    Layer & L = layers_[(size_t) il];
    const int64_t width = t->ne[0], rows = t->ne[1];
    int32_t & have = is_ids ? L.k : L.n_expert;
    if (have != 0 && have != width) {
        // the warm-up graph routes to all experts (k = E): a different width is not this layer's routing
        if (error_.empty()) {
            error_ = std::string("node ") + t->name + " changed width from " + std::to_string(have) + " to " +
                     std::to_string(width);
        }
        return;
    }
    have = (int32_t) width;
    const size_t row_bytes = (size_t) width * 4;
    const size_t old = is_ids ? L.ids.size() : L.scores.size();
    char * out;
    if (is_ids) {
        L.ids.resize(old + (size_t) (width * rows));
        out = (char *) (L.ids.data() + old);
    } else {
        L.scores.resize(old + (size_t) (width * rows));
        out = (char *) (L.scores.data() + old);
    }
    if (ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, out, 0, row_bytes * (size_t) rows);
        return;
    }
    // a strided view (ggml_argsort_top_k returns the first k columns of the argsort): row by row
    for (int64_t r = 0; r < rows; ++r) {
        ggml_backend_tensor_get(t, out + (size_t) r * row_bytes, (size_t) r * t->nb[1], row_bytes);
    }
}

std::vector<RoutingRecorder::Layer> RoutingRecorder::take() {
    std::vector<Layer> out;
    out.swap(layers_);
    return out;
}

}  // namespace hybrimoe
