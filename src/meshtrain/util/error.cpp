#include "meshtrain/util/error.h"
