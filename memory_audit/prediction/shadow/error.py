"""The one error a shadow run ends in (shadow/step.py re-exports it): the step could not run on fake
tensors, or the code asked for what the shadow does not run; str() is one line naming where."""


class ShadowError(ValueError):
    """The step could not run on fake tensors; str() names the last op and the reason."""
