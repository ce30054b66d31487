{
  description = "liger-kernels: fused Triton SwiGLU/GeGLU and a tiled MLP for long-sequence training";

  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    { self, kernel-builder }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
