// The activation memory per image of each network, as measured by faceshard-bench --mode
// activations (activation_probe.h) and kept in app/plan/activations.json, which the build
// compiles into the binaries: faceshard-plan needs no data file at run time. A file of the
// same format can be read instead (faceshard-plan --activations FILE).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "app/plan/activation_probe.h"

namespace faceshard {

struct ActivationEntry {
  std::string network;
  std::string precision;  // fp32 | bf16 | fp16
  bool checkpointing = false;
  int64_t parameters = 0;
  double bytes_per_image = 0;
  double fixed_bytes = 0;
};

class ActivationTable {
 public:
  // The table compiled into the binary (app/plan/activations.json at build time).
  static ActivationTable shipped();
  // A JSON file written by faceshard-bench --mode activations --json FILE.
  static ActivationTable from_file(const std::string& path);
  // JSON text; errors (usage) name `source` and the entry.
  static ActivationTable parse(const std::string& json, const std::string& source);

  // The entry of (network, precision, checkpointing), or nullptr.
  const ActivationEntry* find(const std::string& network, const std::string& precision, bool checkpointing) const;
  // find(), or a usage error naming what was asked and the networks measured.
  const ActivationEntry& at(const std::string& network, const std::string& precision, bool checkpointing) const;
  const std::vector<ActivationEntry>& entries() const { return entries_; }
  const std::string& source() const { return source_; }
  const std::string& measured_on() const { return measured_on_; }  // e.g. "cpu, torch 2.11.0"

 private:
  std::vector<ActivationEntry> entries_;
  std::string source_, measured_on_;
};

// The JSON faceshard-bench writes (and ActivationTable::parse reads).
std::string activation_table_json(const std::vector<ActivationMeasurement>& measurements, const std::string& measured_on);

}  // namespace faceshard
