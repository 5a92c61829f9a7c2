"""What reads and writes model files: the GGUF reader, the block formats and their tensors, the
quantizers, checkpoints, converters from Hugging Face folders and the AWQ reader."""
