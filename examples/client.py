"""Talk to a running `brigade serve` with the official openai client.

python examples/client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

import openai


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


if __name__ == "__main__":
    main()
