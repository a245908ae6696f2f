#include "policy/cost_model.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace hybrimoe {

void CostModel::validate() const {
    const struct {
        const char * name;
        double value;
    } fields[] = {
        {"cpu_a_s", cpu_a_s},     {"cpu_b_s", cpu_b_s},     {"cpu_c_s", cpu_c_s},     {"cpu_startup_s", cpu_startup_s},
        {"gpu_a_s", gpu_a_s},     {"gpu_b_s", gpu_b_s},     {"h2d_bandwidth_Bps", h2d_bandwidth_Bps},
        {"h2d_latency_s", h2d_latency_s}, {"act_a_s", act_a_s}, {"act_b_s", act_b_s},
        {"layer_a_s", layer_a_s}, {"layer_b_s", layer_b_s}, {"dense_a_s", dense_a_s},
        {"dense_b_s", dense_b_s}, {"copy_overlap", copy_overlap}, {"cpu_copy_overlap", cpu_copy_overlap},
        {"disk_bandwidth_Bps", disk_bandwidth_Bps}, {"disk_latency_s", disk_latency_s},
        {"disk_queue_depth", disk_queue_depth},
    };
    for (const auto & f : fields) {
        if (!std::isfinite(f.value) || f.value < 0.0) {
            throw std::invalid_argument(std::string("CostModel.") + f.name + " must be finite and >= 0, got " +
                                        std::to_string(f.value));
        }
    }
    if (h2d_bandwidth_Bps <= 0.0) {
        throw std::invalid_argument("CostModel.h2d_bandwidth_Bps must be > 0");
    }
    if (copy_overlap > 1.0) {
        throw std::invalid_argument("CostModel.copy_overlap must be in [0, 1], got " + std::to_string(copy_overlap));
    }
    if (disk_queue_depth < 1.0) {
        throw std::invalid_argument("CostModel.disk_queue_depth must be >= 1 (reads in flight at once), got " +
                                    std::to_string(disk_queue_depth));
    }
    if (cpu_copy_overlap > 1.0) {
        throw std::invalid_argument("CostModel.cpu_copy_overlap must be in [0, 1], got " +
                                    std::to_string(cpu_copy_overlap));
    }
}

}  // namespace hybrimoe
