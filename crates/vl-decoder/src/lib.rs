//! vl-decoder
