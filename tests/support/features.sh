# Sourced by tests that use features other branches add: probes that never train.
#   has_subcommand MESHTRAIN NAME        `meshtrain NAME` exists (listed by --help)
#   has_config_key MESHTRAIN TOML KEY    KEY is a config key (an override with a bad value
#                                        is refused for its value, not as an unknown key)
# (Output captured first: under `set -o pipefail` a pipe would carry meshtrain's exit code.)
has_subcommand() {
  local help
  help=$("$1" --help 2>/dev/null)
  grep -qE "^  +$2( |$)" <<<"$help"
}
has_config_key() {
  local out
  out=$("$1" train --config "$2" "--$3" "not-a-value" 2>&1)
  ! grep -qF "unknown key '$3'" <<<"$out"
}
