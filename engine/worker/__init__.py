"""Running the model on a device: the runner (one target pass per step), the sampler and
structured-output masks, model loading (``loader``, ``model_store``, ``gguf_file``), and the
GPU's static step buffers, CUDA graphs and memory sizing."""
