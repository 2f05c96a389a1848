"""What one request may ask for. Every request is checked against these bounds where it enters
(`SamplingParams`, `distengine.inputs`, the server's bodies), the same for `LLM`, `AsyncLLM` and
HTTP, so that nothing that passes can fail to encode in a step, overflow a tensor of the sampler,
or make a step's host work grow without bound. A value past a bound is refused (`ValueError`,
HTTP 400) naming the field and the bound.

vLLM leaves most lists unbounded; OpenAI bounds some (4 stop strings, 300 logit_bias entries).
These are generous for real use and small enough that the per-token checks stay cheap.
"""

MAX_INT = 2 ** 31 - 1            # max_tokens, min_tokens, top_k, logprobs: what an int32 holds
MAX_STOP_STRINGS = 128           # stop strings of a request, each checked against every new token
MAX_STOP_STRING_CHARS = 1024     # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024        # stop_token_ids of a request
MAX_PROMPTS_PER_REQUEST = 1024   # prompts of one /v1/completions request
MAX_PROMPT_LOGPROBS = 20        # top tokens per prompt position (vLLM's max_logprobs)
MAX_N = 128                      # completions of one prompt (n, best_of): each a request of its own
MAX_MESSAGES = 4096              # messages of one chat request
MAX_TOOLS = 1024                 # tools of one chat request
MAX_TOKEN_IDS = 1 << 20          # token ids of one prompt or /detokenize request, before the length checks


def bad_text(text: str) -> bool:
    """A string that UTF-8 cannot carry (a lone surrogate, which JSON's \\ud800 can make): it
    could be neither tokenized nor sent back."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
