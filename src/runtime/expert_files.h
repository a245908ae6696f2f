// Where a model's routed experts lie in its GGUF files, and a read-only mapping of those bytes.
//
// Two readers need the file's own bytes of an expert: the RAM tier (ram_tier.h), which reads experts that are not
// in RAM from the files, and the GPU copies of experts whose host tensor ggml-cpu keeps repacked. Upstream's CPU
// "extra" buffer type (CPU_REPACK, ggml-cpu/repack.cpp) interleaves the rows of Q4_0, Q4_K, IQ4_NL, MXFP4 (and, by
// CPU, other) matrices in groups of 8 for its gemv/gemm kernels; a device kernel reads the file's layout, so a copy
// to a GPU slot takes the expert's bytes from the file (MappedExperts) instead of from the repacked tensor.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace hybrimoe {

/// Where each MoE layer's routed experts lie in the model's files (Python fills it from the GGUF's tensor offsets:
/// hybrimoe.runtime.ram_tier.expert_file_ranges).
struct ExpertFiles {
    std::vector<std::string> files;             ///< the model's GGUF files (one, or every shard of a split model)
    std::vector<int64_t> file_sizes;            ///< bytes each file had when the model was loaded (checked at open)
    std::vector<int64_t> file_mtimes_ns;        ///< and its modification time (ns since the epoch; 0: not checked)
    /// per MoE layer, per matrix region (0 gate or fused gate_up, 1 up, 2 down): the file index (-1: the layer has
    /// no such matrix) and the byte offset of expert 0's matrix in it; expert e's lies expert_bytes[layer][region]
    /// further per expert (the tensor's ggml nb[2])
    std::vector<std::array<int32_t, 3>> file_of;
    std::vector<std::array<int64_t, 3>> offset_of;

    bool empty() const { return files.empty(); }
    /// Throws std::invalid_argument (the message starts with `who`) unless there is one file index and offset per
    /// MoE layer and matrix of `expert_bytes`, a file for each matrix the layer has and none for the others, one size
    /// and modification time per file, and every layer's n_expert experts inside their file.
    void validate(const std::vector<std::array<int64_t, 3>> & expert_bytes, int n_expert, const std::string & who) const;
    /// "" when the open file `fd` (file index f) still has the size and modification time it had at load, else
    /// what changed (fills `st`).
    std::string change(size_t f, int fd, struct stat & st) const;
};

/// The experts' file bytes through a read-only shared mapping of each file (the page cache's pages: no memory of
/// the process's own; a page not in the page cache is read from the disk at its first touch).
class MappedExperts {
public:
    /// Maps every file of `where` (validated against `expert_bytes` and `n_expert`). Throws std::invalid_argument on
    /// tables that disagree, std::runtime_error naming the file when one cannot be opened or mapped or changed since
    /// the load.
    MappedExperts(const ExpertFiles & where, const std::vector<std::array<int64_t, 3>> & expert_bytes, int n_expert);
    ~MappedExperts();
    MappedExperts(const MappedExperts &) = delete;
    MappedExperts & operator=(const MappedExperts &) = delete;

    /// Address of expert `expert`'s matrix `region` (0 gate or gate_up, 1 up, 2 down) of MoE layer `layer` in the
    /// mapping: expert_bytes[layer][region] bytes in the file's layout; nullptr where the layer has no such matrix.
    const uint8_t * matrix(int layer, int region, int expert) const;

private:
    ExpertFiles where_;
    std::vector<std::array<int64_t, 3>> expert_bytes_;
    std::vector<const uint8_t *> maps_;
    std::vector<size_t> map_bytes_;
};

}  // namespace hybrimoe
