"""A RunPod serverless worker around the serving stack: `python -m llmplatform.serverless`.

`config.py` reads the environment (worker-vllm's variable names where they apply), `stack.py`
runs a controller, a model worker and the gateway on loopback as `serve` does, `jobs.py` parses a
job's input into a gateway request and `handler.py` answers jobs through the runpod SDK.
"""
