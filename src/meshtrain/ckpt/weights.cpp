#include "meshtrain/ckpt/weights.h"

#include <algorithm>

#include <set>

#include "meshtrain/util/error.h"

namespace meshtrain {

void save_model_weights(const Model& model, const std::string& path, DType dtype,
                        const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter writer;
  for (const Parameter& p : model.params()) writer.add(p.spec.name, p.master, dtype);
  for (const auto& [key, value] : metadata) writer.set_metadata(key, value);
  writer.write(path);
}

void load_model_weights(Model& model, const SafetensorsReader& reader) {
  std::set<std::string, std::less<>> wanted;
  for (Parameter& p : model.params()) {
    MESHTRAIN_CHECK(reader.contains(p.spec.name), "{}: tensor '{}' is missing (model needs {})",
                    reader.path(), p.spec.name, shape_str(p.spec.shape));
    reader.read(p.spec.name, p.master);
    wanted.insert(p.spec.name);
  }
  for (const StTensorInfo& t : reader.tensors()) {
    MESHTRAIN_CHECK(wanted.count(t.name) == 1, "{}: tensor '{}' is not a parameter of this {} model",
                    reader.path(), t.name, family_name(model.config().family));
  }
  model.sync_compute_weights();
}

void load_model_weights(Model& model, const std::string& path) {
  SafetensorsReader reader(path);
  load_model_weights(model, reader);
}

TensorSource model_tensors(const Model& model) {
  return [&model](const ParamSpec& spec, float* out) {
    model.copy_master_to_host(model.param(spec.name), out);
  };
}

}  // namespace meshtrain
