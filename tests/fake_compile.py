"""torch.compile for tests on a machine whose compiled path must be exercised or made to fail."""


class FakeCompile:
    """torch.compile for a device that compiles: the kernel is the function itself, run eagerly;
    it fails on the calls listed in ``fail`` (0 is the first), as a compile error or a later
    runtime error would."""

    def __init__(self, fail=()):
        self.fail, self.calls, self.options = set(fail), 0, None

    def __call__(self, fn, **kwargs):
        self.options = kwargs.get("options")

        def kernel(*args):
            self.calls += 1
            if self.calls - 1 in self.fail:
                raise RuntimeError("CUDA out of memory")
            return fn(*args)
        return kernel
