"""`sgl_kernel` for the real SGLang server on a CPU, where SGLang's CUDA kernel package cannot be imported (it needs
libcuda) and no CPU build of it is published.

SGLang's CPU path (`SGLANG_USE_CPU_ENGINE=1`, `--attention-backend torch_native`) imports a few names from it at
start-up but calls none of them. Every name here is a function that raises, naming itself: should SGLang ever call
one, the contract suite fails loudly instead of computing something else. `make install-sglang-cpu` copies this
module into the server's environment; nothing of miles-flow imports it.
"""


def __getattr__(name: str):
    if name.startswith("__"):  # import machinery probes (__path__, __spec__, ...) get the usual answer
        raise AttributeError(name)

    def not_on_cpu(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called: it is a CUDA kernel that SGLang's CPU path must not call"
        )

    not_on_cpu.__name__ = name
    return not_on_cpu
