#include "meshtrain/util/text_file.h"

#include <fstream>
#include <sstream>

#include "meshtrain/util/error.h"

namespace meshtrain {

std::string read_file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "{}: cannot open", path);
  std::stringstream text;
  text << in.rdbuf();
  MESHTRAIN_CHECK_AS(ErrorKind::io, !in.bad(), "{}: read error", path);
  return text.str();
}

}  // namespace meshtrain
