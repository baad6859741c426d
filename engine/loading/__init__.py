"""Model loading: checkpoint directories, configs, the embedded model and the reference shapes."""
