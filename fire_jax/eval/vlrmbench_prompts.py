"""VLRMBench (Ruan et al., 2025) prompt templates and task table.

The twelve task prompts and the two judge prompts are the official release's
(JCruan519/VLRMBench, model_eval/eval_prompt_files.py), verbatim. The two dicts
at the bottom were generated from tests/fixtures/vlrmbench/prompts.json with
repr(), one source line per prompt line, and tests/test_vlrmbench.py compares
every character with that file: edit the table, never the prompts.

Placeholders (filled with str.format): {question}; {reasoning_process} (step
tasks, FF, ERA, EC); {ai_respond_1} / {ai_respond_2} (MJ and both judges);
{reasoning_error} (ERA judge).
"""

from typing import NamedTuple


class TaskInfo(NamedTuple):
    short: str  # column name in the paper's Table 3
    file: str  # benchmark file name without .jsonl; the key of TASK_PROMPTS
    theme: str  # "step" | "outcome" | "criticism"
    metric: str  # "weighted_f1" | "accuracy" | "win_tie_lose"


TASKS = (
    TaskInfo("SC", "step_correctness", "step", "weighted_f1"),
    TaskInfo("RD", "redundant_det", "step", "weighted_f1"),
    TaskInfo("CM", "most_confidence", "step", "weighted_f1"),
    TaskInfo("EH", "existence_hallucination", "step", "weighted_f1"),
    TaskInfo("AH", "attribute_hallucination", "step", "weighted_f1"),
    TaskInfo("DE", "detail_error", "step", "weighted_f1"),
    TaskInfo("SR", "location_error", "step", "weighted_f1"),
    TaskInfo("IC", "image_ref_error", "step", "weighted_f1"),
    TaskInfo("MJ", "multi_solution", "outcome", "accuracy"),
    TaskInfo("FF", "foresight", "outcome", "accuracy"),
    TaskInfo("ERA", "error_reason_analysis", "criticism", "win_tie_lose"),
    TaskInfo("EC", "error_correction", "criticism", "win_tie_lose"),
)

_BY_NAME = {name: t for t in TASKS for name in (t.short, t.file)}


def task_info(name: str) -> TaskInfo:
    """The task called `name`, by short name ("IC") or file name ("image_ref_error")."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown VLRMBench task {name!r}; expected one of "
                         f"{[t.short for t in TASKS]} or {[t.file for t in TASKS]}") from None


# Generated from prompts.json (keys: task file names). Do not edit.
TASK_PROMPTS = {
    'step_correctness': (
        '## Task Description\n'
        "Based on the provided image, question and AI assistant's reasoning process, your task is to identify the steps that contains errors in the reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- You need to assign an integral indicator to each step. 0 indicates that the step does not contain errors, and 1 indicates that the step contains errors. \n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI assistant's reasoning process\n"
        '{reasoning_process}\n'
        '\n'
        '## Output Format\n'
        '[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n'
        '\n'
        '## Your Output: \n'
    ),
    'redundant_det': (
        '## Task Description\n'
        "Based on the provided image, question and AI assistant's reasoning process, your task is to identify the steps that contains redundancy in the reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- The redundancy may involve unnecessary elaboration, repetitive expressions, or redundant details that do not contribute to the correctness of the reasoning.\n'
        '- You need to assign an integral indicator to each step. 0 indicates that the step does not contain redundancy, and 1 indicates that the step contains redundancy. \n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI assistant's reasoning process\n"
        '{reasoning_process}\n'
        '\n'
        '## Output Format\n'
        '[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n'
        '\n'
        '## Your Output: \n'
    ),
    'most_confidence': (
        '## Task Description\n'
        "Based on the provided image, question and AI assistant's reasoning process, your task is to identify the steps that contains errors in the reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- You need to assign an integral indicator to each step. 0 indicates that the step does not contain errors, and 1 indicates that the step contains errors. \n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI assistant's reasoning process\n"
        '{reasoning_process}\n'
        '\n'
        '## Output Format\n'
        '[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n'
        '\n'
        '## Your Output: \n'
    ),
    'existence_hallucination': (
        '## Task Description\n'
        "Based on the provided image, question and AI assistant's reasoning process, your task is to identify the steps that contains existence hallucination error in the reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- There is at least one error in the reasoning process.\n'
        '- The term "existence hallucination error" refers to errors in reasoning where a model either: Introduces entities that do not exist in the image (e.g., hallucinating objects, people, digit, or details not present), or Fails to acknowledge entities that are actually present in the image (e.g., ignoring critical objects or contextual elements).\n'
        '- You need to assign an integral indicator to each step. 0 indicates that the step does not contain errors, and 1 indicates that the step contains errors. \n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI assistant's reasoning process\n"
        '{reasoning_process}\n'
        '\n'
        '## Output Format\n'
        '[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n'
        '\n'
        '## Your Output: \n'
    ),
    'attribute_hallucination': (
        '## Task Description\n'
        "Based on the provided image, question and AI assistant's reasoning process, your task is to identify the steps that contains Attribute hallucination error in the reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- There is at least one error in the reasoning process.\n'
        '- The term "Attribute hallucination error" refers to errors in reasoning where a model Misidentifies properties (e.g., size, color, shape) of entities in an image.\n'
        '- You need to assign an integral indicator to each step. 0 indicates that the step does not contain errors, and 1 indicates that the step contains errors. \n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI assistant's reasoning process\n"
        '{reasoning_process}\n'
        '\n'
        '## Output Format\n'
        '[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n'
        '\n'
        '## Your Output: \n'
    ),
    'detail_error': (
        '## Task Description\n'
        "Based on the provided image, question and AI assistant's reasoning process, your task is to identify the steps that contains detail error in the reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- There is at least one error in the reasoning process.\n'
        '- Detail errors refer to errors in which numbers or calculated symbols are wrong - You need to assign an integral indicator to each step. 0 indicates that the step does not contain errors, and 1 indicates that the step contains errors. \n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI assistant's reasoning process\n"
        '{reasoning_process}\n'
        '\n'
        '## Output Format\n'
        '[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n'
        '\n'
        '## Your Output: \n'
    ),
    'location_error': (
        '## Task Description\n'
        "Based on the provided image, question and AI assistant's reasoning process, your task is to identify the steps that contains location errors in the reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- There is at least one error in the reasoning process.\n'
        '- You need to assign an integral indicator to each step. 0 indicates that the step does not contain errors, and 1 indicates that the step contains errors. \n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI assistant's reasoning process\n"
        '{reasoning_process}\n'
        '\n'
        '## Output Format\n'
        '[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n'
        '\n'
        '## Your Output: \n'
    ),
    'image_ref_error': (
        '## Task Description\n'
        "Based on the provided image, question and AI assistant's reasoning process, your task is to identify the steps that contains image reference errors in the reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- There is at least one error in the reasoning process.\n'
        '- The term "Image reference error" refers to a mistake where the model incorrectly identifies an entity from one image as being present in another image.\n'
        '- You need to assign an integral indicator to each step. 0 indicates that the step does not contain errors, and 1 indicates that the step contains errors. \n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI assistant's reasoning process\n"
        '{reasoning_process}\n'
        '\n'
        '## Output Format\n'
        '[Indicator for STEP 1, Indicator for STEP 2, ..., Indicator for STEP N]\n'
        '\n'
        '## Your Output: \n'
    ),
    'multi_solution': (
        '## Task Description\n'
        'You are an expert judge specializing in assessing AI-generated responses. \n'
        '## Instructions\n'
        "- Your role is to objectively evaluate the quality of two AI assistants' responses based on the given image and question. \n"
        '- Assign a score to each response on a scale of 0 to 10, where 0 indicates a response that is entirely illogical or irrelevant, and 10 signifies a response that is exceptionally well-reasoned, accurate, and directly addresses the question.\n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI Assistant's Response 1\n"
        '{ai_respond_1}\n'
        '\n'
        "## AI Assistant's Response 2\n"
        '{ai_respond_2}\n'
        '\n'
        '## Output Format\n'
        'Return a List containing two scores:\n'
        '["Score for Response 1", "Score for Response 2"]\n'
        '\n'
        '## Your Output: \n'
    ),
    'foresight': (
        '## Task Description\n'
        "Based on the provided image, question and part of the AI assistant's reasoning process, Your task is to evaluate whether the given partial reasoning process will lead to a correct final answer.\n"
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI Assistant's Partial Reasoning Process\n"
        '{reasoning_process}\n'
        '\n'
        '## Only output Yes or No without additional explanation: \n'
    ),
    'error_reason_analysis': (
        '## Task Description\n'
        "You are an expert in analyzing the causes of errors in the reasoning process. Based on the given image, question, and AI assistant's reasoning process (which contains errors), your task is to critically analyze the reasoning, identify incorrect steps, explain the errors in detail.\n"
        '\n'
        '## Instructions\n'
        '- Identify each incorrect step or assumption in the reasoning process.\n'
        '- For each error, provide a detailed explanation of why it is incorrect, and describe the underlying cause of the error.\n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI Assistant's Reasoning Process\n"
        '{reasoning_process}\n'
        '\n'
        '## Your output: \n'
    ),
    'error_correction': (
        '## Task Description\n'
        "You are an expert in reasoning process correction. Based on the given image, a question, an AI assistant's reasoning process (which contains errors), your task is to identify and correct the errors in the reasoning process, providing a fully corrected reasoning process.\n"
        '\n'
        '## Instructions\n'
        '- Correct any logical flaws or misinterpretations in the reasoning.\n'
        '- Structure the corrected reasoning process clearly in a step-by-step manner.\n'
        '- Ensure that your modified reasoning follows a logical flow that leads to the correct answer.\n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI Assistant's Reasoning Process\n"
        '{reasoning_process}\n'
        '\n'
        '## Your modified process must follow this format: ["STEP1: ...", "STEP2: ...", ...]\n'
        '\n'
        '## Your output: \n'
    ),
}

# Generated from prompts.json (keys 'judge/<task>' without the prefix). Do not edit.
JUDGE_PROMPTS = {
    'error_reason_analysis': (
        '## Task Description\n'
        'You are an experienced judge specializing in assessing AI-generated responses. \n'
        "Based on the given image, a question, and an incorrect reasoning process, along with two AI assistant's responses (which include an analysis of the reasoning errors), your task is to evaluate the quality of each AI assistant's response. \n"
        '\n'
        '## Instructions\n'
        '- Judge which AI response provides a clearer and more logical analysis of the errors.\n'
        '- Assign a score to each response from 0 to 10:\n'
        '  - 0 represents a response that identifies no errors.\n'
        '  - 10 represents a response that fully identifies all errors and provides a clear, logical, and reasonable analysis of the causes.\n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        '## Incorrect Reasoning Process\n'
        '{reasoning_error}\n'
        '\n'
        "## AI Assistant's Response 1\n"
        '{ai_respond_1}\n'
        '\n'
        "## AI Assistant's Response 2\n"
        '{ai_respond_2}\n'
        '\n'
        '## Output Format \n'
        'Return a list containing two scores: \n'
        '["Score for Response 1", "Score for Response 2"]\n'
        '\n'
        '## Your Output:\n'
    ),
    'error_correction': (
        '## Task Description\n'
        'You are an expert judge specializing in assessing AI-generated responses. \n'
        '## Instructions\n'
        "- Your role is to objectively evaluate the quality of two AI assistants' responses based on the given image and question. \n"
        '- Assign a score to each response on a scale of 0 to 10, where 0 indicates a response that is entirely illogical or irrelevant, and 10 signifies a response that is exceptionally well-reasoned, accurate, and directly addresses the question.\n'
        '\n'
        '## Question\n'
        '{question}\n'
        '\n'
        "## AI Assistant's Response 1\n"
        '{ai_respond_1}\n'
        '\n'
        "## AI Assistant's Response 2\n"
        '{ai_respond_2}\n'
        '\n'
        '## Output Format\n'
        'Return a List containing two scores:\n'
        '["Score for Response 1", "Score for Response 2"]\n'
        '\n'
        '## Your Output: \n'
    ),
}
