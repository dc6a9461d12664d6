#include "meshtrain/launch/command.h"

#include <charconv>

#include "meshtrain/util/error.h"

namespace meshtrain::launch {
namespace {

bool is_meshtrain(const std::string& arg) { return base_name(arg).starts_with("meshtrain"); }

// Index of the first argument that is the meshtrain binary; argv.size() if none.
size_t binary_position(const Argv& argv) {
  for (size_t i = 0; i < argv.size(); ++i) {
    if (is_meshtrain(argv[i])) return i;
  }
  return argv.size();
}

bool parse_count(const std::string& text, int* out) {
  int value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || value <= 0) return false;
  *out = value;
  return true;
}

// Where the rank count's value is: (argument index, prefix kept before the value).
struct CountSite {
  size_t index = 0;
  std::string prefix;  // "--ntasks=", "-n" for "-n4", "" for a separate value
  int value = 0;
};

std::optional<CountSite> find_count(const Argv& argv) {
  const size_t end = binary_position(argv);
  for (size_t i = 0; i < end; ++i) {
    const std::string& a = argv[i];
    for (const char* flag : {"-np", "-n", "--np", "--n", "-c", "--ntasks"}) {
      int value = 0;
      if (a == flag && i + 1 < end && parse_count(argv[i + 1], &value)) {
        return CountSite{i + 1, "", value};
      }
      const std::string eq = std::string(flag) + "=";
      if (a.starts_with("--") && a.starts_with(eq) && parse_count(a.substr(eq.size()), &value)) {
        return CountSite{i, eq, value};
      }
    }
    int value = 0;
    if (a.size() > 2 && a.starts_with("-n") && a[2] != 'p' && parse_count(a.substr(2), &value)) {
      return CountSite{i, "-n", value};  // srun -n4
    }
  }
  return std::nullopt;
}

}  // namespace

std::string base_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool is_mpi_launcher(const std::string& name) {
  for (const char* n : {"mpirun", "mpiexec", "orterun", "orted", "prterun", "prted", "prte"}) {
    if (name == n) return true;
  }
  return false;
}

std::vector<size_t> train_positions(const Argv& argv) {
  std::vector<size_t> out;
  for (size_t i = 1; i < argv.size(); ++i) {
    if (argv[i] == "train" && is_meshtrain(argv[i - 1])) out.push_back(i);
  }
  return out;
}

Argv train_arguments(const Argv& argv) {
  const std::vector<size_t> at = train_positions(argv);
  Argv out;
  if (at.empty()) return out;
  for (size_t i = at.front() + 1; i < argv.size() && argv[i] != ":"; ++i) out.push_back(argv[i]);
  return out;
}

Argv with_resume_auto(const Argv& argv) {
  const std::vector<size_t> at = train_positions(argv);
  Argv out;
  size_t next = 0;
  for (size_t i = 0; i < argv.size(); ++i) {
    out.push_back(argv[i]);
    if (next < at.size() && i == at[next]) {
      ++next;
      bool has_resume = false;
      for (size_t j = i + 1; j < argv.size() && argv[j] != ":"; ++j) {
        if (argv[j] == "--resume" || argv[j].starts_with("--resume=")) has_resume = true;
      }
      if (!has_resume) {
        out.push_back("--resume");
        out.push_back("auto");
      }
    }
  }
  return out;
}

std::optional<int> rank_count(const Argv& argv) {
  std::optional<CountSite> site = find_count(argv);
  if (!site) return std::nullopt;
  return site->value;
}

Argv with_rank_count(const Argv& argv, int ranks) {
  std::optional<CountSite> site = find_count(argv);
  MESHTRAIN_CHECK(site.has_value(),
                  "launch: the command gives no rank count (-np N, -n N, --ntasks=N) to change");
  Argv out = argv;
  out[site->index] = site->prefix + std::to_string(ranks);
  return out;
}

Argv with_exported_env(const Argv& argv, const std::vector<std::string>& names) {
  if (argv.empty() || !is_mpi_launcher(base_name(argv[0]))) return argv;
  Argv out{argv[0]};
  for (const std::string& name : names) {
    out.push_back("-x");
    out.push_back(name);
  }
  out.insert(out.end(), argv.begin() + 1, argv.end());
  return out;
}

}  // namespace meshtrain::launch
