"""The gated delta rule of Gated DeltaNet layers: the torch reference, fla-core, and the decode-step kernels."""
