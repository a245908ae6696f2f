// DecisionRecord <-> Python dict, shared by hybrimoe._engine (Engine.take_log) and hybrimoe._core
// (replay_decisions): the engine's log is plain data that the simulator reads back.
#pragma once

#include "policy/decision.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

namespace hybrimoe_bind {

namespace py = pybind11;

inline py::dict decision_to_dict(const hybrimoe::DecisionRecord & r) {
    py::dict d;
    d["ubatch"] = r.ubatch;
    d["layer"] = r.layer;
    d["n_tokens"] = r.n_tokens;
    d["top_k"] = r.top_k;
    // [T, k]; a prefetch-only record has none: [0, k]
    const py::ssize_t rows = r.top_k ? (py::ssize_t) (r.ids.size() / (size_t) r.top_k) : 0;
    py::array_t<int32_t> ids({rows, (py::ssize_t) r.top_k});
    std::copy(r.ids.begin(), r.ids.end(), ids.mutable_data());
    d["ids"] = ids;
    const py::ssize_t E = r.n_tokens ? (py::ssize_t) (r.scores.size() / (size_t) r.n_tokens) : 0;
    py::array_t<float> sc({(py::ssize_t) r.n_tokens, E});
    std::copy(r.scores.begin(), r.scores.end(), sc.mutable_data());
    d["scores"] = sc;
    d["expert_bytes"] = r.expert_bytes;
    d["now_s"] = r.now_s;
    d["pcie_free_s"] = r.pcie_free_s;
    d["experts"] = r.experts;
    d["loads"] = r.loads;
    d["cached"] = r.cached;
    d["ready_s"] = r.ready_s;
    d["on_disk"] = r.on_disk;
    d["read_s"] = r.read_s;
    d["read_slots"] = r.read_slots;
    d["planned_gpu"] = r.planned_gpu;
    d["on_gpu"] = r.on_gpu;
    d["loaded"] = r.loaded;
    d["declined"] = r.declined;
    d["filled"] = r.filled;
    d["first_use"] = r.first_use;
    d["prefetched"] = r.prefetched;
    d["evicted"] = r.evicted;
    d["makespan_s"] = r.makespan_s;
    d["extra_copy_bytes"] = r.extra_copy_bytes;
    d["extra_copies"] = r.extra_copies;
    d["post_launch_copy_bytes"] = r.post_launch_copy_bytes;
    d["post_launch_copies"] = r.post_launch_copies;
    d["measured_s"] = r.measured_s;
    d["prefetch_only"] = r.prefetch_only;
    py::list preds;
    for (const auto & p : r.predictions) {
        py::dict q;
        q["layer"] = p.layer;
        q["distance"] = p.distance;
        q["confidence"] = p.confidence;
        q["start_s"] = p.start_s;
        q["expert_bytes"] = p.expert_bytes;
        q["experts"] = p.experts;
        q["loads"] = p.loads;
        preds.append(q);
    }
    d["predictions"] = preds;
    return d;
}

template <typename T>
std::vector<T> field_or_empty(const py::dict & d, const char * key) {
    if (!d.contains(key)) return {};
    return d[key].cast<std::vector<T>>();
}

/// Raises ValueError (naming the record and the key) when a required key is missing or has the wrong type.
inline hybrimoe::DecisionRecord decision_from_dict(py::handle h, size_t index) {
    const std::string where = "decision record " + std::to_string(index);
    if (!py::isinstance<py::dict>(h)) throw py::value_error(where + " is not a dict");
    const py::dict d = py::reinterpret_borrow<py::dict>(h);
    hybrimoe::DecisionRecord r;
    const char * key = "";
    try {
        key = "ubatch"; r.ubatch = d[key].cast<int64_t>();
        key = "layer"; r.layer = d[key].cast<int>();
        key = "n_tokens"; r.n_tokens = d[key].cast<int>();
        key = "top_k"; r.top_k = d[key].cast<int>();
        key = "ids";
        auto ids = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(d[key]);
        if (!ids) throw py::cast_error();
        r.ids.assign(ids.data(), ids.data() + ids.size());
        key = "scores";
        if (d.contains(key) && !d[key].is_none()) {
            auto sc = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(d[key]);
            if (!sc) throw py::cast_error();
            r.scores.assign(sc.data(), sc.data() + sc.size());
        }
        key = "expert_bytes"; r.expert_bytes = d[key].cast<double>();
        key = "now_s"; r.now_s = d[key].cast<double>();
        key = "pcie_free_s"; r.pcie_free_s = d[key].cast<double>();
        key = "first_use"; r.first_use = field_or_empty<int32_t>(d, key);
        key = "predictions";
        if (d.contains(key)) {
            for (py::handle ph : d[key]) {
                if (!py::isinstance<py::dict>(ph)) throw py::cast_error();
                const py::dict q = py::reinterpret_borrow<py::dict>(ph);
                hybrimoe::Prediction p;
                p.layer = q["layer"].cast<int>();
                p.distance = q["distance"].cast<int>();
                p.confidence = q["confidence"].cast<double>();
                p.start_s = q["start_s"].cast<double>();
                p.expert_bytes = q["expert_bytes"].cast<double>();
                p.experts = q["experts"].cast<std::vector<int32_t>>();
                p.loads = q["loads"].cast<std::vector<int32_t>>();
                r.predictions.push_back(std::move(p));
            }
        }
        // decisions (optional: a log to replay needs only the inputs above)
        key = "experts"; r.experts = field_or_empty<int32_t>(d, key);
        key = "loads"; r.loads = field_or_empty<int32_t>(d, key);
        key = "cached"; r.cached = field_or_empty<uint8_t>(d, key);
        key = "ready_s"; r.ready_s = field_or_empty<double>(d, key);
        key = "on_disk"; r.on_disk = field_or_empty<uint8_t>(d, key);
        key = "read_s"; r.read_s = d.contains(key) ? d[key].cast<double>() : 0.0;
        key = "read_slots"; r.read_slots = d.contains(key) ? d[key].cast<int>() : 1;
        key = "planned_gpu"; r.planned_gpu = field_or_empty<uint8_t>(d, key);
        key = "on_gpu"; r.on_gpu = field_or_empty<uint8_t>(d, key);
        key = "loaded"; r.loaded = field_or_empty<int32_t>(d, key);
        key = "declined"; r.declined = field_or_empty<int32_t>(d, key);
        key = "filled"; r.filled = field_or_empty<int32_t>(d, key);
        key = "prefetched"; r.prefetched = field_or_empty<std::pair<int, int>>(d, key);
        key = "evicted"; r.evicted = field_or_empty<int64_t>(d, key);
        key = "makespan_s"; r.makespan_s = d.contains(key) ? d[key].cast<double>() : 0.0;
        key = "extra_copy_bytes"; r.extra_copy_bytes = d.contains(key) ? d[key].cast<double>() : 0.0;
        key = "extra_copies"; r.extra_copies = d.contains(key) ? d[key].cast<int>() : 0;
        key = "post_launch_copy_bytes"; r.post_launch_copy_bytes = d.contains(key) ? d[key].cast<double>() : 0.0;
        key = "post_launch_copies"; r.post_launch_copies = d.contains(key) ? d[key].cast<int>() : 0;
        key = "measured_s"; r.measured_s = d.contains(key) ? d[key].cast<double>() : -1.0;
        key = "prefetch_only"; r.prefetch_only = d.contains(key) ? d[key].cast<bool>() : false;
    } catch (const py::error_already_set & e) {
        if (e.matches(PyExc_KeyError)) throw py::value_error(where + ": key '" + key + "' is missing");
        throw py::value_error(where + ": key '" + key + "' has the wrong type or shape");
    } catch (const py::cast_error &) {
        throw py::value_error(where + ": key '" + key + "' has the wrong type or shape");
    }
    return r;
}

inline std::vector<hybrimoe::DecisionRecord> decisions_from_list(py::iterable log) {
    std::vector<hybrimoe::DecisionRecord> out;
    size_t i = 0;
    for (py::handle h : log) out.push_back(decision_from_dict(h, i++));
    return out;
}

inline py::list decisions_to_list(const std::vector<hybrimoe::DecisionRecord> & log) {
    py::list out;
    for (const auto & r : log) out.append(decision_to_dict(r));
    return out;
}

}  // namespace hybrimoe_bind
