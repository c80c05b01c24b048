//! vl-shapes
