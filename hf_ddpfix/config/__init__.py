"""The options: `DDPFixConfig` (every option once, with its environment variables; `options`) and the parsers of one setting's value (`parsers`)."""
