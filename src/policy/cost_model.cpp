#include "policy/cost_model.h"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace hybrimoe {

void CostModel::validate() const {
    const struct {
        const char * name;
        double value;
    } fields[] = {
        {"cpu_a_s", cpu_a_s},     {"cpu_b_s", cpu_b_s},     {"cpu_startup_s", cpu_startup_s},
        {"gpu_a_s", gpu_a_s},     {"gpu_b_s", gpu_b_s},     {"h2d_bandwidth_Bps", h2d_bandwidth_Bps},
        {"h2d_latency_s", h2d_latency_s}, {"act_a_s", act_a_s}, {"act_b_s", act_b_s},
        {"layer_a_s", layer_a_s}, {"layer_b_s", layer_b_s}, {"dense_a_s", dense_a_s},
        {"dense_b_s", dense_b_s}, {"copy_overlap", copy_overlap}, {"cpu_copy_overlap", cpu_copy_overlap},
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
    if (cpu_copy_overlap > 1.0) {
        throw std::invalid_argument("CostModel.cpu_copy_overlap must be in [0, 1], got " +
                                    std::to_string(cpu_copy_overlap));
    }
}

// ---- JSON (schema hybrimoe.cost_model/3, documented in cost_model.h) ----------------------------------------------

namespace {

/// The numeric fields of the schema, in document order, with the CostModel member each one fills.
struct CostField {
    const char * name;
    double CostModel::*member;
    int since;  // the first schema version with the field (older documents read the CostModel default)
};
const CostField kCostFields[] = {
    {"cpu_a_s", &CostModel::cpu_a_s, 1},     {"cpu_b_s", &CostModel::cpu_b_s, 1},
    {"cpu_startup_s", &CostModel::cpu_startup_s, 1},
    {"gpu_a_s", &CostModel::gpu_a_s, 1},     {"gpu_b_s", &CostModel::gpu_b_s, 1},
    {"h2d_bandwidth_Bps", &CostModel::h2d_bandwidth_Bps, 1},
    {"h2d_latency_s", &CostModel::h2d_latency_s, 1},
    {"act_a_s", &CostModel::act_a_s, 1},     {"act_b_s", &CostModel::act_b_s, 1},
    {"layer_a_s", &CostModel::layer_a_s, 1}, {"layer_b_s", &CostModel::layer_b_s, 1},
    {"dense_a_s", &CostModel::dense_a_s, 1}, {"dense_b_s", &CostModel::dense_b_s, 1},
    {"copy_overlap", &CostModel::copy_overlap, 2},
    {"cpu_copy_overlap", &CostModel::cpu_copy_overlap, 3},
};

/// A parsed JSON value (only as much structure as this flat schema needs; arrays are kept for error messages).
struct JsonValue {
    enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
    bool boolean = false;
    double number = 0.0;
    std::string text;                                     // kString: the string; kNumber: the literal as written
    std::vector<JsonValue> items;                         // kArray
    std::vector<std::pair<std::string, JsonValue>> members;  // kObject, in document order
};

const char * kind_name(JsonValue::Kind k) {
    switch (k) {
        case JsonValue::kNull: return "null";
        case JsonValue::kBool: return "boolean";
        case JsonValue::kNumber: return "number";
        case JsonValue::kString: return "string";
        case JsonValue::kArray: return "array";
        case JsonValue::kObject: return "object";
    }
    return "?";
}

/// Recursive-descent reader of RFC 8259 JSON; errors carry the line and column.
class JsonReader {
public:
    explicit JsonReader(const std::string & s) : s_(s) {}

    JsonValue document() {
        JsonValue v = value(0);
        skip_ws();
        if (i_ != s_.size()) fail("extra data after the JSON value");
        return v;
    }

private:
    [[noreturn]] void fail(const std::string & what) const {
        size_t line = 1, col = 1;
        for (size_t k = 0; k < i_ && k < s_.size(); ++k) {
            if (s_[k] == '\n') {
                ++line;
                col = 1;
            } else {
                ++col;
            }
        }
        throw std::runtime_error(what + " (line " + std::to_string(line) + ", column " + std::to_string(col) + ")");
    }
    void skip_ws() {
        while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
    }
    bool literal(const char * word) {
        const size_t n = std::strlen(word);
        if (s_.compare(i_, n, word) == 0) {
            i_ += n;
            return true;
        }
        return false;
    }
    JsonValue value(int depth) {
        if (depth > 64) fail("nesting too deep");
        skip_ws();
        if (i_ >= s_.size()) fail("unexpected end of document");
        JsonValue v;
        const char c = s_[i_];
        if (c == '{') {
            v.kind = JsonValue::kObject;
            ++i_;
            skip_ws();
            if (i_ < s_.size() && s_[i_] == '}') {
                ++i_;
                return v;
            }
            for (;;) {
                skip_ws();
                if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string key");
                std::string key = string();
                skip_ws();
                if (i_ >= s_.size() || s_[i_] != ':') fail("expected ':' after a key");
                ++i_;
                v.members.emplace_back(std::move(key), value(depth + 1));
                skip_ws();
                if (i_ < s_.size() && s_[i_] == ',') {
                    ++i_;
                    continue;
                }
                if (i_ < s_.size() && s_[i_] == '}') {
                    ++i_;
                    return v;
                }
                fail("expected ',' or '}' in an object");
            }
        }
        if (c == '[') {
            v.kind = JsonValue::kArray;
            ++i_;
            skip_ws();
            if (i_ < s_.size() && s_[i_] == ']') {
                ++i_;
                return v;
            }
            for (;;) {
                v.items.push_back(value(depth + 1));
                skip_ws();
                if (i_ < s_.size() && s_[i_] == ',') {
                    ++i_;
                    continue;
                }
                if (i_ < s_.size() && s_[i_] == ']') {
                    ++i_;
                    return v;
                }
                fail("expected ',' or ']' in an array");
            }
        }
        if (c == '"') {
            v.kind = JsonValue::kString;
            v.text = string();
            return v;
        }
        if (literal("true")) {
            v.kind = JsonValue::kBool;
            v.boolean = true;
            return v;
        }
        if (literal("false")) {
            v.kind = JsonValue::kBool;
            return v;
        }
        if (literal("null")) return v;
        // Python's json module writes these for non-finite floats; read them so the field check can name them.
        if (literal("NaN")) return number_value("NaN", std::numeric_limits<double>::quiet_NaN());
        if (literal("Infinity")) return number_value("Infinity", std::numeric_limits<double>::infinity());
        if (literal("-Infinity")) return number_value("-Infinity", -std::numeric_limits<double>::infinity());
        return number();
    }
    static JsonValue number_value(const char * text, double x) {
        JsonValue v;
        v.kind = JsonValue::kNumber;
        v.number = x;
        v.text = text;
        return v;
    }
    JsonValue number() {
        // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
        const size_t start = i_;
        auto digits = [&]() {
            const size_t d0 = i_;
            while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
            return i_ > d0;
        };
        if (i_ < s_.size() && s_[i_] == '-') ++i_;
        if (i_ < s_.size() && s_[i_] == '0') {
            ++i_;
        } else if (!digits()) {
            i_ = start;
            fail("expected a value");
        }
        if (i_ < s_.size() && s_[i_] == '.') {
            ++i_;
            if (!digits()) fail("expected digits after '.'");
        }
        if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
            ++i_;
            if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
            if (!digits()) fail("expected digits in an exponent");
        }
        const std::string lit = s_.substr(start, i_ - start);
        errno = 0;
        const double x = std::strtod(lit.c_str(), nullptr);  // "C" locale digits; overflow gives inf (caught later)
        return number_value(lit.c_str(), x);
    }
    void utf8(uint32_t cp, std::string & out) {
        if (cp < 0x80) {
            out += static_cast<char>(cp);
        } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
            out += static_cast<char>(0xF0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        }
    }
    uint32_t hex4() {
        if (i_ + 4 > s_.size()) fail("truncated \\u escape");
        uint32_t cp = 0;
        for (int k = 0; k < 4; ++k) {
            const char h = s_[i_++];
            cp <<= 4;
            if (h >= '0' && h <= '9') cp |= static_cast<uint32_t>(h - '0');
            else if (h >= 'a' && h <= 'f') cp |= static_cast<uint32_t>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') cp |= static_cast<uint32_t>(h - 'A' + 10);
            else fail("bad \\u escape");
        }
        return cp;
    }
    std::string string() {
        ++i_;  // opening quote
        std::string out;
        for (;;) {
            if (i_ >= s_.size()) fail("unterminated string");
            const char c = s_[i_++];
            if (c == '"') return out;
            if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
            if (c != '\\') {
                out += c;
                continue;
            }
            if (i_ >= s_.size()) fail("unterminated string");
            const char e = s_[i_++];
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    uint32_t cp = hex4();
                    if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(i_, 2, "\\u") == 0) {
                        i_ += 2;
                        const uint32_t lo = hex4();
                        if (lo < 0xDC00 || lo >= 0xE000) fail("bad surrogate pair");
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    }
                    utf8(cp, out);
                    break;
                }
                default: fail(std::string("bad escape '\\") + e + "'");
            }
        }
    }

    const std::string & s_;
    size_t i_ = 0;
};

/// JSON string literal of s (quotes, backslashes and control characters escaped; other bytes as they are).
std::string quote(const std::string & s) {
    std::string out = "\"";
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out += buf;
        } else {
            out += static_cast<char>(c);
        }
    }
    return out + "\"";
}

}  // namespace

CostModel cost_model_from_json(const std::string & text, const std::string & where,
                               std::map<std::string, std::string> * sources) {
    JsonValue doc;
    try {
        doc = JsonReader(text).document();
    } catch (const std::runtime_error & e) {
        throw CostModelError(where + " is not valid JSON: " + e.what());
    }
    if (doc.kind != JsonValue::kObject) {
        throw CostModelError(where + ": expected a JSON object, got " + kind_name(doc.kind));
    }
    const JsonValue * schema = nullptr;
    std::string unknown;
    for (const auto & m : doc.members) {
        bool known = m.first == "schema" || m.first == "sources";
        for (const CostField & f : kCostFields) known = known || m.first == f.name;
        if (m.first == "schema") schema = &m.second;
        if (!known) unknown += (unknown.empty() ? "" : ", ") + m.first;
    }
    int version = 0;
    if (schema && schema->kind == JsonValue::kString) {
        version = schema->text == kCostModelSchema ? 3 : schema->text == kCostModelSchemaV2 ? 2
                  : schema->text == kCostModelSchemaV1 ? 1 : 0;
    }
    if (version == 0) {
        const std::string got = !schema ? "nothing" : schema->kind == JsonValue::kString ? quote(schema->text)
                                                                                          : kind_name(schema->kind);
        throw CostModelError(where + ": 'schema' must be '" + kCostModelSchema + "' (or '" + kCostModelSchemaV2 +
                             "', '" + kCostModelSchemaV1 + "'), got " + got);
    }
    if (!unknown.empty()) throw CostModelError(where + ": unknown field(s) " + unknown);
    CostModel cm;
    for (const CostField & f : kCostFields) {
        const JsonValue * v = nullptr;
        for (const auto & m : doc.members) {
            if (m.first == f.name) v = &m.second;  // a repeated key: the last one wins, as in Python's json
        }
        if (f.since > version) {
            if (v) throw CostModelError(where + ": field '" + f.name + "' is not in schema " + schema->text);
            continue;  // an older schema: the default (copies overlap compute and cost the CPU nothing)
        }
        if (!v) throw CostModelError(where + ": missing field '" + f.name + "'");
        if (v->kind != JsonValue::kNumber || !std::isfinite(v->number) || v->number < 0.0) {
            const std::string got = v->kind == JsonValue::kNumber ? v->text
                                    : v->kind == JsonValue::kString ? quote(v->text) : kind_name(v->kind);
            throw CostModelError(where + ": field '" + f.name + "' must be a finite number >= 0, got " + got);
        }
        cm.*(f.member) = v->number;
    }
    if (cm.h2d_bandwidth_Bps <= 0.0) throw CostModelError(where + ": field 'h2d_bandwidth_Bps' must be > 0");
    if (cm.copy_overlap > 1.0) throw CostModelError(where + ": field 'copy_overlap' must be in [0, 1]");
    if (cm.cpu_copy_overlap > 1.0) throw CostModelError(where + ": field 'cpu_copy_overlap' must be in [0, 1]");
    if (sources) {
        sources->clear();
        for (const auto & m : doc.members) {
            if (m.first != "sources") continue;
            if (m.second.kind != JsonValue::kObject) {
                throw CostModelError(where + ": 'sources' must be an object of strings, got " +
                                     kind_name(m.second.kind));
            }
            for (const auto & s : m.second.members) {
                if (s.second.kind != JsonValue::kString) {
                    throw CostModelError(where + ": sources['" + s.first + "'] must be a string");
                }
                (*sources)[s.first] = s.second.text;
            }
        }
    }
    return cm;
}

std::string cost_model_to_json(const CostModel & cm, const std::map<std::string, std::string> & sources) {
    std::string out = std::string("{\n  \"schema\": ") + quote(kCostModelSchema);
    for (const CostField & f : kCostFields) {
        const double x = cm.*(f.member);
        if (!std::isfinite(x)) {
            throw CostModelError(std::string("cost_model_to_json: field '") + f.name + "' is not finite");
        }
        char buf[40];
        std::snprintf(buf, sizeof buf, "%.17g", x);
        out += ",\n  " + quote(f.name) + ": " + buf;
    }
    if (!sources.empty()) {
        out += ",\n  \"sources\": {";
        bool first = true;
        for (const auto & s : sources) {
            out += (first ? "\n    " : ",\n    ") + quote(s.first) + ": " + quote(s.second);
            first = false;
        }
        out += "\n  }";
    }
    return out + "\n}\n";
}

CostModel load_cost_model(const std::string & path, std::map<std::string, std::string> * sources) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw CostModelError("cannot read cost model " + path + ": " + std::strerror(errno));
    std::ostringstream text;
    text << in.rdbuf();
    if (in.bad()) throw CostModelError("cannot read cost model " + path);
    return cost_model_from_json(text.str(), "cost model " + path, sources);
}

void save_cost_model(const CostModel & cm, const std::string & path,
                     const std::map<std::string, std::string> & sources) {
    const std::string text = cost_model_to_json(cm, sources);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw CostModelError("cannot write cost model " + path + ": " + std::strerror(errno));
    out << text;
    out.flush();
    if (!out) throw CostModelError("cannot write cost model " + path);
}

}  // namespace hybrimoe
