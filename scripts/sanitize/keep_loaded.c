/* Linked into every executable of a sanitizer build (scripts/sanitize.sh): dlclose does
 * nothing, so a library Open MPI loads and unloads again (the components it opens, queries and
 * does not select) stays mapped until exit. Otherwise what it allocated and never freed shows
 * up in LeakSanitizer's reports as "<unknown module>", which no suppression can name, and
 * ThreadSanitizer's frames through it have no names. Never part of a normal build. */
int dlclose(void* handle) {
  (void)handle;
  return 0;
}
