# Sourced by tests that use features other branches add: probes that never train.
#   has_subcommand MESHTRAIN NAME        `meshtrain NAME` exists (listed by --help)
#   has_config_key MESHTRAIN TOML KEY    KEY is a config key (an override with a bad value
#                                        is refused for its value, not as an unknown key)
has_subcommand() {
  "$1" --help 2>/dev/null | grep -qE "^  +$2( |$)"
}
has_config_key() {
  ! "$1" train --config "$2" "--$3" "not-a-value" 2>&1 | grep -qF "unknown key '$3'"
}
