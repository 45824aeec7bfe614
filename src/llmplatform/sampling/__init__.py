"""What the engine and every backend share, below both of them.

Per DESIGN.md this layer sits under the engine and the backends (they import it; it imports
neither, nor the models and kernels): sampling parameters (:mod:`.params`), the batched sampler
with its grammar masks (:mod:`.sampler`), output processing: incremental detokenization, stop
strings, partial UTF-8 (:mod:`.output_processor`), the chunk types a generation yields
(:mod:`.outputs`), context-length arithmetic (:mod:`.context_length`), structured-output specs and
their grammars (:mod:`.structured_output`, :mod:`.grammar`). Tool-call formats and parsers are the
gateway's alone (``openai_api.tools``).
"""
