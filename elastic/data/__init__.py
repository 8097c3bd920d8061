"""Data as people keep it: text and token files, Parquet, JSONL, plain text a document a line,
HuggingFace datasets saved to disk and Megatron ``.bin``/``.idx`` pairs, tokenized on the
ranks, packed into windows and mixed by weight.

``formats`` is the one table of the formats: each one's suffixes and probe for ``auto``, its
opener and its check. ``streams`` reads token streams by byte range; ``documents`` (and
``text_lines``) read a file's documents by row; ``tokenizing`` turns them into token ids;
``packing`` lays them end to end and cuts the windows a sample is; ``megatron`` reads a token
stream someone else packed; ``mixture`` weighs several sources into one dataset whose order
keeps every source's every sample exactly once. ``elastic.setup.dataset`` builds these from a
config, and the data plan (``elastic.core.data_plan``) orders their samples as any other.
"""
