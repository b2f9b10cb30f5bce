"""The options.

- `options`: `DDPFixConfig`, every option once with the environment variables that set it.
- `parsers`: the parsers of one setting's value; each error names the setting, the bad value and the allowed values.
"""
