"""One parser per model family: `parse(config_json_dict) -> ModelConfig`, registered by HF `model_type` in
`megadecode.config.PARSERS`."""
