// The torch-free builds of the parsers (the fuzz targets, the AddressSanitizer tests) have no
// margin heads (each head is LibTorch code): their config takes loss.head's value as it comes
// and no loss.<head>.* key. The catalogue's own checks run in the main test binary.
#include "partial_fc/classifier/head_catalogue.h"

namespace faceshard {
void register_margin_heads() {}
}  // namespace faceshard
