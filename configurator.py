"""Command-line and config-file overrides for train.py's module globals.

    python train.py config/audit_reference.py --batch_size=8 --audit

Arguments without `--` are config files (Python, executed, may set any known global);
`--key=value` overrides one global with a value of the same type; a bare `--flag` sets a
boolean global to True. Unknown keys, wrong types and missing files raise ConfigError with a
one-line message.
"""

import os
from ast import literal_eval


class ConfigError(ValueError):
    pass


def _coerce(key, value, current):
    if current is None:
        return value
    if isinstance(current, bool):
        if value in ("True", "true", "1"):
            return True
        if value in ("False", "false", "0"):
            return False
        raise ConfigError(f"--{key} expects True or False, got {value!r}")
    try:
        parsed = literal_eval(value)
    except (SyntaxError, ValueError):
        parsed = value  # a bare string such as --dtype=bfloat16
    if isinstance(current, float) and isinstance(parsed, int) and not isinstance(parsed, bool):
        parsed = float(parsed)
    if type(parsed) is not type(current):
        raise ConfigError(f"--{key} expects {type(current).__name__}, got {value!r}")
    return parsed


def apply_overrides(config, argv):
    """Apply config files and --key=value arguments to the dict `config` (in place).

    Returns the set of keys that were given explicitly.
    """
    given = set()
    for arg in argv:
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg}")
            scope = {}
            try:
                with open(arg) as f:
                    exec(f.read(), {}, scope)
            except Exception as e:
                raise ConfigError(f"config file {arg} failed: {type(e).__name__}: {e}") from None
            for key, value in scope.items():
                if key.startswith("_"):
                    continue
                if key not in config:
                    raise ConfigError(f"unknown config key {key!r} in {arg}")
                config[key] = value
                given.add(key)
            continue
        body = arg[2:]
        key, sep, value = body.partition("=")
        if key not in config:
            raise ConfigError(f"unknown config key {key!r}")
        if not sep:
            if not isinstance(config[key], bool):
                raise ConfigError(f"--{key} needs a value: --{key}=...")
            config[key] = True
        else:
            config[key] = _coerce(key, value, config[key])
        given.add(key)
    return given
