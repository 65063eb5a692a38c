defmodule EMLXAxon.TextGeneration do
  @moduledoc """
  Text generation with a Qwen model: text (or chat messages) in, text out.

  `run/4` and `stream/5` generate directly in the calling process and need
  nothing but this library. `serving/3` wraps the same generation in an
  `Nx.Serving` (when your application has Nx), so requests from many
  processes, or nodes, are batched together.

  The forward pass, sampling and KV cache all run natively on MLX (see
  `EMLXAxon.Qwen3.Generate`); several inputs given together, or batched by
  the serving, are decoded as one batch.

  ## Usage

      {:ok, tokenizer} = EMLXAxon.Tokenizer.load("~/models/Qwen3-0.6B-MLX-4bit")
      {:ok, state} = EMLXAxon.Qwen3.Loader.load("~/models/Qwen3-0.6B-MLX-4bit")

      %{results: [%{generated_text: text}]} =
        EMLXAxon.TextGeneration.run(tokenizer, state, "Write a haiku about the sea.",
          max_new_tokens: 64
        )

      EMLXAxon.TextGeneration.stream(tokenizer, state, "Tell me a story.", &IO.write/1)

  With Nx:

      serving =
        EMLXAxon.TextGeneration.from_mlx4bit("~/models/Qwen3-0.6B-MLX-4bit", nil,
          max_new_tokens: 100,
          sampler: :greedy
        )

      result = Nx.Serving.run(serving, "Write a short story about a robot who learns to love.")
      IO.puts(result.results |> hd() |> Map.fetch!(:generated_text))

  Code written for Bumblebee's text generation servings runs unchanged:
  `serving/3` and `from_mlx4bit/3` take the tokenizer from
  `Bumblebee.load_tokenizer/1`, inputs may carry a `:seed`, results have
  Bumblebee's `:text` and `:token_summary`, and Bumblebee's serving options
  are accepted.

  ## Inputs

    * a string: the prompt text (with `chat: true`, sent as a user message
      through the chat template)
    * `%{text: string}`: the same
    * a list of chat messages, such as `[%{role: "user", content: "Hi"}]`
      (see `EMLXAxon.Tokenizer.apply_chat_template/3`), or
      `%{messages: messages}`: rendered with the chat template, ending with
      the assistant's turn
    * `%{input_ids: [integer]}`: an already tokenized prompt
    * a list of any of the above: a batch, decoded together; the result is
      then a list, in the same order

  An input map may also hold `:seed` (a non-negative integer), as
  Bumblebee allows: that input is sampled with its own random numbers,
  seeded so, whatever else it is batched with (`%{text: "Hi", seed: 7}`
  gives the same tokens alone, in a list, or merged by the serving with
  other callers' inputs). Inputs without one use the `:seed` option.

  ## Output

  For one input, Bumblebee's output around an `EMLXAxon.Result` (see
  there for every key):

      %{
        results: [
          %{
            text: "...",
            generated_text: "...",
            token_ids: [...],
            num_tokens: 17,
            finish_reason: :eos | :stop | :length | :max_len | :timeout,
            token_summary: %{input: 12, output: 17, padding: 0}
          }
        ],
        metadata: %{prompt_tokens: 12, generated_tokens: 17, batch_size: 1, prefill_ms: ...,
                    decode_path: ..., prefill_path: ..., fallbacks: ..., kv_dtype: ..., ...}
      }

  `metadata` describes the batch the input was decoded in: when the
  serving splits a list of inputs over several executions, each output
  describes its own. With `profile_timing: false` only the token counts,
  `batch_size` and `total_ms` are measured; the other timings are 0.0.

  ## Structured output

  `:json_schema` (a map, or JSON text), `:regex` or `:grammar` (Lark syntax,
  as llguidance reads it) constrain what is generated: at every step the
  tokens that cannot continue a valid output are masked out before
  sampling, whatever the sampler. Give at most one. As options they apply
  to every input; `run/4`, `stream/5` and `serving/3` also take them per
  input (`%{text: t, json_schema: schema}`), so constrained and free inputs
  can share a batch (a free row samples exactly as it would alone). A
  serving checks each input's constraint in the caller (a bad one raises
  there, not in the batch it would have joined) and batches an input with
  a constraint only with other callers' constrained inputs of a similar
  size (the text travels inside the batch, padded to a size bucket), up to
  4 MiB per input.

  A constrained row ends with `finish_reason: :stop` once its output is
  complete (nothing but the end of the text may follow), or `:eos` when the
  model ends an output that could also go on. A schema's JSON is written
  without optional whitespace, with `", "` and `": "` separators. A bad
  schema, regex or grammar raises `ArgumentError` before anything is
  generated; schema keywords the grammar engine does not support are named.

      %{results: [%{text: json}]} =
        EMLXAxon.TextGeneration.run(tokenizer, state, "A person as JSON:",
          json_schema: %{type: "object", properties: %{name: %{type: "string"}},
                         required: ["name"]}
        )

  ## Tool calls

  With `tools:` (a list of tool definitions, as transformers takes them;
  see `EMLXAxon.ToolCalls.check_tool/1`),
  chat inputs are rendered with the tools offered (see
  `EMLXAxon.Tokenizer.apply_chat_template/3`), and each result gets
  `tool_calls: [%{name: name, arguments: map}]` (the answer's
  `<tool_call>` blocks) and `tool_call_errors` (the malformed ones). To
  make the model answer with valid calls only, add
  `grammar: EMLXAxon.ToolCalls.grammar(tools)`.

  ## Options

  `run/4`, `stream/5`, `serving/3` and `from_mlx4bit/3` each list the
  options they take; the options of one input (`:seed`, `:json_schema`,
  `:regex`, `:grammar`) go in the input map.

  ## Through a scheduler

  With `scheduler:` (the pid or name of an `EMLXAxon.Scheduler` serving
  the same `state`, started with a `:tokenizer`), `run/4` and `stream/5`
  submit each input as its own request, joining the scheduler's running
  batch, with its own seed (its input's `:seed`, else the `:seed` option),
  its own constraint (its input's `:json_schema`, `:regex` or `:grammar`,
  else the option's) and the generation options; `:timeout` applies to
  each request. Outputs have the usual shape, without padding
  (`token_summary.padding` is 0), and `metadata` holds the request's own
  counts and timings (with `:queue_ms`, `:cached_tokens` and
  `:constraint_ms`). `:chunk_size` and `:profile_timing` do not apply (text
  arrives after every decode step of the scheduler). An
  `EMLXAxon.Stream` and a `state` other than the scheduler's raise
  `ArgumentError`; a full queue raises `EMLXAxon.Error` (kind
  `:overloaded`). When the call ends early (an `emit_fun` that raises, an
  error), its requests are cancelled. For `serving/3`, see its "With a
  scheduler".

  Unknown options and out-of-range values raise `ArgumentError`.
  """

  alias EMLXAxon.{Generation, Tokenizer}
  alias EMLXAxon.Qwen3.{Loader, Model.State}
  alias EMLXAxon.TextGeneration.{Config, Input, Output, Scheduled, TokenizerSource}

  @serving_module EMLXAxon.TextGeneration.Serving

  @typedoc "One input: see the module documentation."
  @type input ::
          String.t()
          | %{required(:text) => String.t(), optional(:seed) => non_neg_integer() | nil}
          | %{
              required(:messages) => [Tokenizer.message()],
              optional(:seed) => non_neg_integer() | nil
            }
          | %{
              required(:input_ids) => [non_neg_integer()],
              optional(:seed) => non_neg_integer() | nil
            }
          | [Tokenizer.message()]

  @typedoc """
  A tokenizer: an `EMLXAxon.Tokenizer`, a Bumblebee tokenizer (from
  `Bumblebee.load_tokenizer/1`), a `Tokenizers.Tokenizer`, or a Hugging
  Face Hub repository to load one from (`{:hf, repo}`: see `EMLXAxon.Hub`;
  loaded on every call, so prefer a loaded tokenizer in `run/4`).
  """
  @type tokenizer :: Tokenizer.t() | struct() | EMLXAxon.Hub.repository()

  @type finish_reason :: EMLXAxon.Result.finish_reason()

  @typedoc "The output for one input: see `EMLXAxon.Result`."
  @type output :: %{results: [EMLXAxon.Result.t()], metadata: EMLXAxon.Result.metadata()}

  ## Serving

  @doc """
  Builds an `Nx.Serving` that generates text with `state` and `tokenizer`.

  Requires Nx in your application (`{:nx, "~> 0.9"}`); without it this
  raises. Takes the options listed below (Bumblebee's serving options
  among them).

  `tokenizer` is an `EMLXAxon.Tokenizer`, or the tokenizer a Bumblebee
  application already has: the struct `Bumblebee.load_tokenizer/1` returns
  or a bare `Tokenizers.Tokenizer`. Those are copied into an
  `EMLXAxon.Tokenizer` through the `tokenizers` package; they carry no chat
  template, so for chat inputs pass an `EMLXAxon.Tokenizer` (or use
  `from_mlx4bit/3`, which reads the template from the checkpoint).

  The serving accepts the inputs described in the module documentation
  and returns the same output as `run/4`: plain maps and lists, so it
  works across nodes. Inputs batched together by `Nx.Serving` are decoded
  together as one batch.

  Prompts travel to the serving padded to a length bucket (see `:compile`
  in the module documentation), and only prompts of one bucket are
  batched together.

  With `stream: true`, `Nx.Serving.run/2` and `Nx.Serving.batched_run/2`
  return a stream of text chunks instead (one input at a time), ending
  with `{:done, %{token_summary: summary, results: [result], metadata: metadata}}`
  when `stream_done: true`.

  Started with `partitions: true`, each partition gets its own
  `EMLXAxon.Stream`, so partitions decode concurrently; set the number of
  partitions with `defn_options: [max_concurrency: n]`.

  ## Continuous batching

  By default a serving decodes through `EMLXAxon.Scheduler`s: a serving
  process (`Nx.Serving.start_link/1`) starts one per partition, all on the
  one `state`, under a supervisor linked to it (restarted when one fails,
  stopped with the serving); an inline `Nx.Serving.run/2` starts one for the
  run. Executions only route their rows to a scheduler and return at once:
  each caller then submits its inputs, which join the scheduler's running
  batch between decode steps, and waits for its own tokens. So a request is
  not held back by a batch that is decoding: it starts as soon as the
  scheduler has a free slot. `:max_queue` bounds the requests waiting for a
  slot (past it a caller gets `EMLXAxon.Error`, kind `:overloaded`, at
  once), and `:scheduler_options` sets the schedulers' `:slots`,
  `:capacity` and steps. Without `:slots` a serving's own scheduler decodes
  `compile: [batch_size: n]`'s n rows together (8 without it), as a static
  execution would.

  Since an execution only routes rows, `Nx.Serving`'s `:batch_timeout` is
  then most of what a request that finds the serving idle waits before its
  prompt starts: keep it small (a few milliseconds). Callers that submit
  within a fraction of a millisecond of each other are still seated in
  the scheduler's batch together.

  With `scheduler: false` an execution generates its whole batch before the
  serving (or its partition) takes the next one, so a request that comes
  while a long batch decodes waits for all of it; an execution whose callers
  have all exited stops within a step. A serving given an `EMLXAxon.Stream`
  (`:stream` or `:mlx_stream`) decodes so, on that stream.

  With `scheduler:` the pid or name of an `EMLXAxon.Scheduler` started
  elsewhere with the same `state` and a `:tokenizer`, or a list of them, the
  serving shares it instead of starting its own.

  Through a scheduler, whether its own or shared:

    * outputs are those of `run/4` with `scheduler:` (no padding, each
      input's own timings in `metadata`, `:queue_ms` and `:cached_tokens`);
      inputs, options, per-input seeds and constraints, `tools:`, streaming
      and `stream_done:` work as without a scheduler
    * partition `i` (of `partitions: true` and `defn_options:
      [max_concurrency: n]`) uses the `rem(i, length(schedulers))`-th
      scheduler; a caller's inputs all go to the scheduler of the partition
      that took its first input
    * the scheduler's `:slots`, `:capacity` and `:max_queue` bound what
      runs at once; `:compile`'s `:sequence_length` buckets, `:chunk_size`
      and `:profile_timing` do not apply, and with a shared scheduler
      `:stream`/`:mlx_stream` (an `EMLXAxon.Stream`) raise `ArgumentError`;
      a full scheduler queue raises `EMLXAxon.Error` (kind `:overloaded`) in
      the caller, and a scheduler that exits while a caller waits raises
      `EMLXAxon.Error` (kind `:scheduler_down`) in it within a second
    * the tokens are received by the process that runs the client
      postprocessing: the caller's own for `Nx.Serving.run/2` and a local
      `Nx.Serving.batched_run/2`; for a caller on another node, the process
      `Nx.Serving` runs on the serving's node for it, which sends the result
      (or, streaming, each piece) back. When that process exits its
      requests are dropped, and reading only part of a stream cancels the
      rest; for a remote caller neither happens (`Nx.Serving`'s process
      there reads the whole stream and outlives the caller), so its
      requests run to their end

  ## Options

  #{EMLXAxon.Options.docs(Config.serving_schema())}

  ## Examples

      serving = EMLXAxon.TextGeneration.serving(tokenizer, state, max_new_tokens: 64)
      %{results: [%{text: text}]} = Nx.Serving.run(serving, "Hello")

      children = [
        {Nx.Serving, serving: serving, name: MyApp.LLM, batch_size: 8, batch_timeout: 5}
      ]

      Nx.Serving.batched_run(MyApp.LLM, [%{role: "user", content: "Hi!"}])
      Nx.Serving.batched_run(MyApp.LLM, %{text: "Once upon a time", seed: 7})

      streaming = EMLXAxon.TextGeneration.serving(tokenizer, state, stream: true)
      for chunk <- Nx.Serving.run(streaming, "Tell me a story"), do: IO.write(chunk)

  """
  @spec serving(tokenizer(), State.t(), keyword()) :: struct()
  def serving(tokenizer, state, opts \\ []) do
    tokenizer = TokenizerSource.resolve!(tokenizer)
    state!(state)
    opts = Config.serving!(opts)
    ensure_nx!()
    apply(@serving_module, :new, [tokenizer, state, opts])
  end

  @doc """
  Loads the checkpoint at `path` (and its tokenizer) and builds `serving/3`
  with it. `path` may also be a Hugging Face Hub repository, `{:hf, repo}`
  or `{:hf, repo, options}` (see `EMLXAxon.Hub`), and so may `tokenizer`.

  `tokenizer` may be `nil`, an `EMLXAxon.Tokenizer`, or a Bumblebee or
  `Tokenizers` tokenizer: for the latter two, the same tokenizer is loaded
  from `path` (with its chat template), since the directory is at hand.

  Raises `EMLXAxon.Error` when loading fails.

  ## Options

  Every option of `serving/3`, and `EMLXAxon.Qwen3.Loader.load/2`'s:

  #{EMLXAxon.Options.docs(Keyword.drop(Config.from_mlx4bit_schema(), Keyword.keys(Config.serving_schema())))}

  ## Examples

      serving = EMLXAxon.TextGeneration.from_mlx4bit("~/models/Qwen3-0.6B-MLX-4bit", nil,
        max_new_tokens: 100
      )

      {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, "~/models/Qwen3-0.6B-MLX-4bit"})
      serving = EMLXAxon.TextGeneration.from_mlx4bit("~/models/Qwen3-0.6B-MLX-4bit", tokenizer)

      serving = EMLXAxon.TextGeneration.from_mlx4bit({:hf, "mlx-community/Qwen3-0.6B-4bit"})

  """
  @spec from_mlx4bit(Path.t() | EMLXAxon.Hub.repository(), tokenizer() | nil, keyword()) ::
          struct()
  def from_mlx4bit(path, tokenizer \\ nil, opts \\ []) do
    # Fail on bad options (or a missing Nx) before spending time loading.
    {load_opts, serving_opts} = Config.from_mlx4bit!(opts)
    ensure_nx!()
    dir = checkpoint_dir!(path)
    tokenizer = TokenizerSource.resolve!(tokenizer, dir)
    state = Loader.load!(dir, load_opts)
    serving(tokenizer, state, serving_opts)
  end

  # A Hub repository is fetched once, for both the weights and the tokenizer.
  defp checkpoint_dir!({:hf, _} = repository), do: EMLXAxon.Hub.fetch!(repository)
  defp checkpoint_dir!({:hf, _, _} = repository), do: EMLXAxon.Hub.fetch!(repository)
  defp checkpoint_dir!(path), do: Path.expand(path)

  ## Running directly

  @doc """
  Generates text for `input` in the calling process.

  `input` is one input or a list of them (see the module documentation);
  a list is decoded as one batch and gives a list of outputs, each equal
  to what that input gives alone with greedy decoding.

  `tokenizer` is as in `serving/3`; a Bumblebee or `Tokenizers` tokenizer
  is copied on every call, so prefer an `EMLXAxon.Tokenizer` here.

  Raises `ArgumentError` for bad options or inputs, and `EMLXAxon.Error`
  when generation fails (such as `:prompt_too_long`).

  ## Options

  #{EMLXAxon.Options.docs(Config.run_schema())}

  ## Examples

      %{results: [%{generated_text: text, finish_reason: reason}]} =
        EMLXAxon.TextGeneration.run(tokenizer, state, "The capital of France is",
          max_new_tokens: 8
        )

      [first, second] =
        EMLXAxon.TextGeneration.run(tokenizer, state, ["Hello", [%{role: "user", content: "Hi"}]])

  """
  @spec run(tokenizer(), State.t(), input() | [input()], keyword()) :: output() | [output()]
  def run(tokenizer, state, input, opts \\ []) do
    tokenizer = TokenizerSource.resolve!(tokenizer)
    state!(state)
    opts = Config.run!(opts, false, "EMLXAxon.TextGeneration.run/4")
    {requests, multi?} = Input.requests!(tokenizer, state, input, opts)
    generate!(tokenizer, state, requests, opts, multi?, nil)
  end

  @doc """
  Like `run/4`, but calls `emit_fun` with each piece of generated text as
  soon as it is decoded, then returns what `run/4` would.

  For a single input, `emit_fun` receives binaries; for a list of inputs,
  `{index, binary}` tuples (`index` in the input list). The pieces of an
  input concatenate exactly to its `generated_text`, and never split a
  UTF-8 character.

  If `emit_fun` raises (or throws, or exits), generation stops, its memory
  is freed, and the exception propagates. To stop early on purpose, throw
  from `emit_fun` and catch around this call.

  ## Options

  The options of `run/4`:

  #{EMLXAxon.Options.docs(Config.run_schema())}

  ## Examples

      EMLXAxon.TextGeneration.stream(tokenizer, state, "Tell me a story", &IO.write/1,
        max_new_tokens: 200
      )

      EMLXAxon.TextGeneration.stream(tokenizer, state, ["a", "b"], fn {index, text} ->
        send(self(), {:chunk, index, text})
      end)

  """
  @spec stream(tokenizer(), State.t(), input() | [input()], (term() -> term()), keyword()) ::
          output() | [output()]
  def stream(tokenizer, state, input, emit_fun, opts \\ []) do
    tokenizer = TokenizerSource.resolve!(tokenizer)
    state!(state)

    unless is_function(emit_fun, 1) do
      raise ArgumentError,
            "expected emit_fun to be a function of one argument, got: #{inspect(emit_fun)}"
    end

    opts = Config.run!(opts, true, "EMLXAxon.TextGeneration.stream/5")
    {requests, multi?} = Input.requests!(tokenizer, state, input, opts)

    on_chunk =
      cond do
        opts.scheduler && multi? ->
          emit_fun

        opts.scheduler ->
          fn {0, text} -> emit_fun.(text) end

        multi? ->
          fn rows ->
            rows
            |> Enum.with_index()
            |> Enum.each(fn
              {%{text: ""}, _index} -> :ok
              {%{text: text}, index} -> emit_fun.({index, text})
            end)
          end

        true ->
          fn
            [%{text: ""}] -> :ok
            [%{text: text}] -> emit_fun.(text)
          end
      end

    generate!(tokenizer, state, requests, opts, multi?, on_chunk)
  end

  # Through an EMLXAxon.Scheduler: each input is its own request.
  defp generate!(_tokenizer, state, requests, %{scheduler: scheduler} = opts, multi?, emit)
       when scheduler != nil do
    Scheduled.check!(scheduler, state, requests, opts)

    outputs =
      scheduler
      |> Scheduled.run!(requests, opts, emit)
      |> Enum.map(&Output.put_tool_calls(&1, opts.tools))

    if multi?, do: outputs, else: hd(outputs)
  end

  defp generate!(tokenizer, state, requests, opts, multi?, on_chunk) do
    stream_ref = EMLXAxon.Stream.resolve(opts.mlx_stream)
    prompts = Enum.map(requests, & &1.ids)

    opts =
      opts
      |> Map.put(:row_seeds, Input.row_seeds(requests, opts.seed))
      |> Map.put(:row_constraints, Input.row_constraints(requests, opts.constraint))

    case Generation.run(state, tokenizer, stream_ref, prompts, opts, on_chunk) do
      {:ok, %{rows: rows, stats: stats}} ->
        paddings = Output.paddings(stats.prompt_tokens)

        outputs =
          rows
          |> Enum.zip(Enum.zip(stats.prompt_tokens, paddings))
          |> Enum.with_index()
          |> Enum.map(fn {{row, {prompt_tokens, padding}}, index} ->
            row = Map.merge(row, %{prompt_tokens: prompt_tokens, padding: padding})

            row
            |> Output.build(Generation.row_timings(stats, index))
            |> Output.put_tool_calls(opts.tools)
          end)

        if multi?, do: outputs, else: hd(outputs)

      {:error, error} ->
        raise error
    end
  end

  defp state!(%State{}), do: :ok

  defp state!(other) do
    raise ArgumentError,
          "expected an EMLXAxon.Qwen3.Model.State (from EMLXAxon.Qwen3.Loader.load/2), " <>
            "got: #{inspect(other)}"
  end

  defp ensure_nx! do
    unless Code.ensure_loaded?(@serving_module) do
      raise RuntimeError,
            "EMLXAxon.TextGeneration.serving/3 builds an Nx.Serving, so it needs Nx: " <>
              "add {:nx, \"~> 0.9\"} to your project's dependencies (and run mix deps.get). " <>
              "Without Nx, use EMLXAxon.TextGeneration.run/4 or stream/5."
    end

    :ok
  end
end
