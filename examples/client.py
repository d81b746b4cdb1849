"""Talk to a running `brigade serve` with the official openai client.

python examples/client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import json

import openai

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "temperature": {"type": "integer", "minimum": -60, "maximum": 60},
    },
    "required": ["city", "temperature"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="a key from [server] api_keys")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id

    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about kitchens."}],
        max_tokens=32,
        temperature=0.8,
        seed=7,
    )
    print("chat:", reply.choices[0].message.content, f"({reply.usage})")

    print("stream: ", end="", flush=True)
    for chunk in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=32, stream=True
    ):
        print(chunk.choices[0].text if chunk.choices else "", end="", flush=True)
    print()

    # Structured output: the answer always parses and matches the schema.
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "The weather in Oslo, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
        max_tokens=64,
    )
    print("json:", json.loads(reply.choices[0].message.content or ""))

    # A forced tool call: its arguments are valid for the tool's parameters.
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=128,  # "<tool_call>" and its JSON take ~45 of SmolLM2's tokens
    )
    for call in reply.choices[0].message.tool_calls or []:
        print("tool call:", call.function.name, json.loads(call.function.arguments))


if __name__ == "__main__":
    main()
