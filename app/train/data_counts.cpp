#include "app/train/data_counts.h"

#include <filesystem>

#include "base/error.h"

namespace faceshard {

std::optional<std::string> resolve_data_counts(Config& cfg, const Dataset& ds) {
  DataConfig& data = cfg.data;
  if (data.rec == "synthetic") {
    if (!data.num_classes) throw_config_error(cfg, "data.num_classes", "required with data.rec: synthetic (it has no identities to count)");
    data.num_classes = *data.num_classes + data.spare_classes;
    return std::nullopt;
  }
  const std::string where = "'" + std::filesystem::absolute(data.rec).lexically_normal().string() + "'";
  const int64_t counted = ds.num_classes();  // -1: a .rec without identity records
  const int64_t images = static_cast<int64_t>(ds.size());
  if (counted < 0 && !data.num_classes)
    throw_config_error(cfg, "data.num_classes",
                       where + " has no identity records to count its classes from; set data.num_classes");
  std::optional<std::string> said;
  if (counted >= 0) {
    const int64_t want = counted + data.spare_classes;
    if (data.num_classes && *data.num_classes != want) {
      std::string fix = "; leave data.num_classes out to take the data's count";
      if (*data.num_classes > want)
        fix += detail::concat(", or set data.spare_classes: ", *data.num_classes - counted,
                              " to keep classes the data does not use");
      throw_config_error(cfg, "data.num_classes",
                         detail::concat(*data.num_classes, " but ", where, " has ", counted, " identities",
                                        data.spare_classes ? detail::concat(" + data.spare_classes ", data.spare_classes,
                                                                            " = ", want)
                                                           : std::string(),
                                        fix));
    }
    if (!data.num_classes)
      said = detail::concat("data.num_classes: ", want, " (", counted, " identities counted in ", where,
                            data.spare_classes ? detail::concat(" + ", data.spare_classes, " spare") : std::string(), ")");
    data.num_classes = want;
  }
  if (data.num_images && *data.num_images != images)
    throw_config_error(cfg, "data.num_images",
                       detail::concat(*data.num_images, " but ", where, " has ", images,
                                      " images; leave data.num_images out to take the data's count"));
  return said;
}

std::optional<std::string> count_config_data(Config& cfg) {
  const DataConfig& data = cfg.data;
  if (data.rec == "synthetic" || (data.num_classes && data.num_images)) return std::nullopt;
  std::error_code ec;
  if (data.rec.empty() || !std::filesystem::exists(data.rec, ec)) return std::nullopt;
  ImageFolderOptions folder;  // listed, not read: a plan reads no image
  folder.report = false;
  const std::shared_ptr<Dataset> ds = open_dataset(data.rec, data.num_classes.value_or(0), 1000000,
                                                   default_record_index_options(), folder);
  const bool classes_counted = !data.num_classes;
  resolve_data_counts(cfg, *ds);
  if (!cfg.data.num_images) cfg.data.num_images = static_cast<int64_t>(ds->size());
  const std::string where = std::filesystem::absolute(data.rec).lexically_normal().string();
  return detail::concat("data: ", classes_counted ? detail::concat(*cfg.data.num_classes - data.spare_classes, " identities, ")
                                                  : std::string(),
                        *cfg.data.num_images, " images counted in '", where, "' (as faceshard-train counts them",
                        data.spare_classes && classes_counted ? detail::concat("; + ", data.spare_classes, " spare classes")
                                                              : std::string(),
                        ")");
}

}  // namespace faceshard
