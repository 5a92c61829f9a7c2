"""Prompts no test tunes against: raw text and chat messages of 3..200 tokens (code, prose, questions, other
languages), for the last-position accuracy of the fast path against float32 (tests/test_fast_accuracy.py,
tools/kl_vs_llamacpp.py --prompts)."""

HELD_OUT_TEXT = [
    "Hello there",
    "The sun rose",
    "Water boils at",
    "My favourite programming language is",
    "import numpy as np\nimport",
    "SELECT name, COUNT(*) FROM",
    "The three primary colours are red,",
    "Translate to French: good morning ->",
    "Q: How many legs does a spider have?\nA:",
    "Der schnellste Weg nach Berlin ist",
    "for (int i = 0; i < n; ++i) {\n    sum +=",
    "The mitochondria is the powerhouse of the cell because",
    "Dear Sir or Madam,\n\nI am writing to complain about the",
    "#!/bin/bash\n# back up the home directory every night\ntar -czf",
    "{\"name\": \"Alice\", \"age\": 30, \"languages\": [\"Python\", \"Rust\"], \"city\":",
    "In 1969, Neil Armstrong and Buzz Aldrin became the first humans to walk on the Moon. The mission, called",
    "Recipe for pancakes:\n1. Mix 200 g flour with two eggs.\n2. Add 300 ml milk slowly while whisking.\n3.",
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
     "        self.items.append(item)\n\n    def pop(self):\n"),
    "The derivative of x^2 sin(x) with respect to x is, by the product rule,",
    ("Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
     "foods from carbon dioxide and water. Photosynthesis in plants generally involves the green pigment "
     "chlorophyll and generates oxygen as a byproduct. The overall equation can be written as"),
    ("fn main() {\n    let v: Vec<i32> = (1..=10).collect();\n"
     "    let evens: Vec<i32> = v.iter().filter(|x| *x % 2 == 0)"
     ".cloned().collect();\n    println!(\"{:?}\", evens);\n    let total: i32 = evens.iter().sum();\n    println!("),
    ("The Industrial Revolution, which began in Britain in the late eighteenth century, transformed economies that "
     "had been based on agriculture and handicrafts into economies based on large-scale industry, mechanized "
     "manufacturing, and the factory system. New machines, new power sources, and new ways of organizing work "
     "made existing industries more productive and efficient. Textiles were the first to be mechanized: the "
     "spinning jenny, the water frame and the power loom multiplied what one worker could produce. Steam engines, "
     "improved by James Watt, freed factories from rivers. Railways followed, and with them cheap coal, iron and "
     "the movement of people into growing cities, where working conditions were often harsh and"),
    ("def merge_sort(a):\n    if len(a) <= 1:\n        return a\n    mid = len(a) // 2\n"
     "    left = merge_sort(a[:mid])\n"
     "    right = merge_sort(a[mid:])\n    out = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
     "        if left[i] <= right[j]:\n            out.append(left[i])\n            i += 1\n        else:\n"
     "            out.append(right[j])\n            j += 1\n    out.extend(left[i:])\n    out.extend(right[j:])\n"
     "    return out\n\n\ndef binary_search(a, x):\n    lo, hi = 0, len(a) - 1\n    while lo <= hi:\n"
     "        mid = (lo + hi) // 2\n        if a[mid] == x:\n            return mid\n"),
]
HELD_OUT_CHAT = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is the boiling point of water in Fahrenheit?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three prime numbers."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
    [{"role": "user", "content": "What is the capital of Japan?"},
     {"role": "assistant", "content": "The capital of Japan is Tokyo."},
     {"role": "user", "content": "And how many people live there, roughly?"}],
    [{"role": "user", "content": "Summarize: The committee met on Tuesday to discuss the budget for next year. "
      "After a long debate about funding for the library and the swimming pool, members agreed to raise the "
      "library's budget by ten percent and to delay repairs to the pool until the spring."}],
]
