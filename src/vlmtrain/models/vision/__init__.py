"""Around a vision tower: the dummy image a rank without images runs, the padding to a fixed patch count, one
variable-length attention call over a batch's images, and patch embeddings as one matmul."""
