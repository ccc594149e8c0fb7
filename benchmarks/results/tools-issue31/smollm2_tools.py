"""SmolLM2-135M-Instruct (GGUF): what the chat format renders for calc's tool schema, and the
cost of the schemas in first-observation tokens. Run from the repository root:
`PYTHONPATH=. .venv/bin/python benchmarks/results/tools-issue31/smollm2_tools.py`."""
import time
from transformers import AutoTokenizer
from tests.smollm2 import smollm2_or_exit
from echo_node.ml.tokenizer import HFTokenizerAdapter
from echo_node.envs.format import ChatFormat
from echo_node.envs import Message
from echo_node.envs.calc import CALCULATOR_SCHEMA, CalcEnv

p = smollm2_or_exit()
t0 = time.monotonic()
hf = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
fmt = ChatFormat(HFTokenizerAdapter(hf, chat=True))
obs = Message(role="user", content="12+34=?")
plain, tooled = fmt.first_ids(obs), fmt.first_ids(obs, (CALCULATOR_SCHEMA,))
print("template lists tools:", "tools" in (hf.chat_template or ""))
print("tokens without / with schemas:", len(plain), len(tooled))
print(repr(hf.decode(tooled)[:600]))
env = CalcEnv(); env.reset(1)
step = env.step('<tool_call>{"name": "calculator", "arguments": {"a": 12, "b": 34}}</tool_call>')
assert step.observation is not None
print("hermes call answered:", step.observation)
print("tool answer re-tokenised:", len(fmt.next_ids(step.observation, after_eos=True)), "tokens;", round(time.monotonic() - t0, 1), "s")
