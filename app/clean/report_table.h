// Reading faceshard-clean's reports: tab-separated tables after '#' comment lines (the
// header faceshard-clean writes: the run, the model, the data, the set, the counts, the
// thresholds), then one line of column names. What faceshard-pack clean and the training's
// loss.init_centres read of them.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace faceshard {

std::vector<std::string> split_tabs(const std::string& s);

// `text` as an index in [0, limit); usage error "<where>: <what> '<text>' is not one of the
// set's <limit>" otherwise.
int64_t parse_report_index(const std::string& text, const std::string& where, int64_t limit, const char* what);

// Calls row(values of `columns`, "file:line") for every row of a faceshard-clean report; a
// column named "?name" may be absent (its value then ""). Usage errors: the file cannot be
// opened, has no column line, lacks a column, or a row has too few cells.
void read_report(const std::string& path, const std::vector<std::string>& columns,
                 const std::function<void(const std::vector<std::string>&, const std::string&)>& row);

// The value of the report's "# <name>: " comment line among its header lines (the first 64
// lines, up to the column line), if there is one.
std::optional<std::string> report_comment(const std::string& path, const std::string& name);

}  // namespace faceshard
