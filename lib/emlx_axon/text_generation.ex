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

  ## Output

  For one input:

      %{
        results: [
          %{
            generated_text: "...",
            num_tokens: 17,
            token_ids: [...],
            finish_reason: :eos | :stop | :length | :max_len | :timeout
          }
        ],
        metadata: %{prompt_tokens: 12, generated_tokens: 17, prefill_ms: ..., ...}
      }

  `finish_reason` says why generation ended: `:eos` (the model's end of
  sequence; `token_ids` include it, the text does not), `:stop` (a `:stop`
  string; the text ends just before it), `:length` (`:max_new_tokens`),
  `:max_len` (the `:max_len` KV budget) or `:timeout`. `metadata` holds the
  token counts and timings described in `EMLXAxon.Qwen3.Generate`.

  ## Options

    * `:max_new_tokens` - the most tokens to generate per input (default 100)
    * `:max_len` - the KV cache budget per input, prompt included (default 2048)
    * `:sampler` - `:greedy` (default), `:top_p_cpu` or `:top_p_gpu`
    * `:temperature` - sampling temperature, > 0 (default 1.0)
    * `:top_p` - nucleus probability mass, in (0, 1] (default 0.9)
    * `:top_k` - keep only the k most likely tokens, 0 disables (default 0)
    * `:min_p` - min-p filtering, 0.0 disables (default 0.0)
    * `:seed` - seed for sampling (default `nil`: random)
    * `:stop` - a string or list of strings that end generation
    * `:eos_token_ids` - the tokens ending generation (default: the model's
      and tokenizer's)
    * `:ignore_eos` - generate past EOS (default `false`)
    * `:chat` - render string inputs with the chat template, as a user
      message (default `false`)
    * `:enable_thinking` - Qwen3's thinking switch for the chat template
      (default `nil`: the template's default)
    * `:profile_timing` - measure decode timings (default `true`)
    * `:timeout` - milliseconds after which generation stops with
      `finish_reason: :timeout` (default `:infinity`)
    * `:chunk_size` - tokens decoded per native call, which is also how
      often a timeout is checked and streamed text is delivered (default 16,
      or 4 when streaming)
    * `:stream` - in `serving/3`: `true` for a streaming serving (see below);
      anywhere: an `EMLXAxon.Stream` to run on
    * `:mlx_stream` - an `EMLXAxon.Stream` to run on (for a streaming
      serving, where `:stream` is `true`)
    * `:stream_done` - with a streaming serving, end the stream with
      `{:done, result}` (default `false`)
    * `:defn_options` - accepted for compatibility with Bumblebee servings;
      only `:max_concurrency` is used, as the number of partitions a
      serving started with `partitions: true` runs

  Unknown options and out-of-range values raise `ArgumentError`.
  """

  alias EMLXAxon.{Generation, Options, Tokenizer}
  alias EMLXAxon.Qwen3.{Loader, Model.State}

  @serving_module EMLXAxon.TextGeneration.Serving

  @common_defaults Options.generation_defaults() ++
                     [
                       chat: false,
                       enable_thinking: nil,
                       profile_timing: true,
                       timeout: :infinity,
                       chunk_size: nil,
                       stream: nil,
                       mlx_stream: nil
                     ]

  @serving_defaults @common_defaults ++ [stream_done: false, defn_options: []]
  @loader_options [:dtype, :quantize]

  @run_chunk_size 16
  @stream_chunk_size 4

  @typedoc "One input: see the module documentation."
  @type input ::
          String.t()
          | %{required(:text) => String.t(), optional(atom()) => term()}
          | %{required(:messages) => [Tokenizer.message()]}
          | %{required(:input_ids) => [non_neg_integer()]}
          | [Tokenizer.message()]

  @type finish_reason :: :eos | :stop | :length | :max_len | :timeout

  @type output :: %{
          results: [
            %{
              generated_text: String.t(),
              num_tokens: pos_integer(),
              token_ids: [non_neg_integer()],
              finish_reason: finish_reason()
            }
          ],
          metadata: map()
        }

  ## Serving

  @doc """
  Builds an `Nx.Serving` that generates text with `state` and `tokenizer`.

  Requires Nx in your application (`{:nx, "~> 0.9"}`); without it this
  raises. Takes the options described in the module documentation.

  The serving accepts the inputs described in the module documentation
  and returns the same output as `run/4`: plain maps and lists, so it
  works across nodes. Inputs batched together by `Nx.Serving` are decoded
  together as one batch.

  With `stream: true`, `Nx.Serving.run/2` and `Nx.Serving.batched_run/2`
  return a stream of text chunks instead (one input at a time), ending
  with `{:done, output}` when `stream_done: true`.

  Started with `partitions: true`, each partition gets its own
  `EMLXAxon.Stream`, so partitions decode concurrently; set the number of
  partitions with `defn_options: [max_concurrency: n]`.

  ## Examples

      serving = EMLXAxon.TextGeneration.serving(tokenizer, state, max_new_tokens: 64)
      %{results: [%{generated_text: text}]} = Nx.Serving.run(serving, "Hello")

      children = [
        {Nx.Serving, serving: serving, name: MyApp.LLM, batch_size: 8, batch_timeout: 50}
      ]

      Nx.Serving.batched_run(MyApp.LLM, [%{role: "user", content: "Hi!"}])

      streaming = EMLXAxon.TextGeneration.serving(tokenizer, state, stream: true)
      for chunk <- Nx.Serving.run(streaming, "Tell me a story"), do: IO.write(chunk)

  """
  @spec serving(Tokenizer.t(), State.t(), keyword()) :: struct()
  def serving(tokenizer, state, opts \\ []) do
    tokenizer = tokenizer!(tokenizer)
    state!(state)
    opts = validate_serving_opts!(opts)
    ensure_nx!()
    apply(@serving_module, :new, [tokenizer, state, opts])
  end

  @doc """
  Loads the checkpoint at `path` (and its tokenizer, when `tokenizer` is
  `nil`) and builds `serving/3` with it.

  Besides the serving options, takes `EMLXAxon.Qwen3.Loader.load/2`'s
  `:dtype` and `:quantize`. Raises `EMLXAxon.Error` when loading fails.

  ## Examples

      serving = EMLXAxon.TextGeneration.from_mlx4bit("~/models/Qwen3-0.6B-MLX-4bit", nil,
        max_new_tokens: 100
      )

  """
  @spec from_mlx4bit(Path.t(), Tokenizer.t() | nil, keyword()) :: struct()
  def from_mlx4bit(path, tokenizer \\ nil, opts \\ []) do
    unless Keyword.keyword?(opts) do
      raise ArgumentError,
            "expected EMLXAxon.TextGeneration.from_mlx4bit/3 options to be a keyword list, " <>
              "got: #{inspect(opts)}"
    end

    {load_opts, serving_opts} = Keyword.split(opts, @loader_options)
    # Fail on bad options (or a missing Nx) before spending time loading.
    validate_serving_opts!(serving_opts)
    ensure_nx!()
    tokenizer = if tokenizer == nil, do: Tokenizer.load!(path), else: tokenizer!(tokenizer)
    state = Loader.load!(path, load_opts)
    serving(tokenizer, state, serving_opts)
  end

  ## Running directly

  @doc """
  Generates text for `input` in the calling process.

  `input` is one input or a list of them (see the module documentation);
  a list is decoded as one batch and gives a list of outputs, each equal
  to what that input gives alone with greedy decoding.

  Raises `ArgumentError` for bad options or inputs, and `EMLXAxon.Error`
  when generation fails (such as `:prompt_too_long`).

  ## Examples

      %{results: [%{generated_text: text, finish_reason: reason}]} =
        EMLXAxon.TextGeneration.run(tokenizer, state, "The capital of France is",
          max_new_tokens: 8
        )

      [first, second] =
        EMLXAxon.TextGeneration.run(tokenizer, state, ["Hello", [%{role: "user", content: "Hi"}]])

  """
  @spec run(Tokenizer.t(), State.t(), input() | [input()], keyword()) :: output() | [output()]
  def run(tokenizer, state, input, opts \\ []) do
    tokenizer = tokenizer!(tokenizer)
    state!(state)
    opts = validate_run_opts!(opts, @run_chunk_size, "EMLXAxon.TextGeneration.run/4")
    {prompts, multi?} = prompts!(tokenizer, state, input, opts)
    generate!(tokenizer, state, prompts, opts, multi?, nil)
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

  ## Examples

      EMLXAxon.TextGeneration.stream(tokenizer, state, "Tell me a story", &IO.write/1,
        max_new_tokens: 200
      )

      EMLXAxon.TextGeneration.stream(tokenizer, state, ["a", "b"], fn {index, text} ->
        send(self(), {:chunk, index, text})
      end)

  """
  @spec stream(Tokenizer.t(), State.t(), input() | [input()], (term() -> term()), keyword()) ::
          output() | [output()]
  def stream(tokenizer, state, input, emit_fun, opts \\ []) do
    tokenizer = tokenizer!(tokenizer)
    state!(state)

    unless is_function(emit_fun, 1) do
      raise ArgumentError,
            "expected emit_fun to be a function of one argument, got: #{inspect(emit_fun)}"
    end

    opts = validate_run_opts!(opts, @stream_chunk_size, "EMLXAxon.TextGeneration.stream/5")
    {prompts, multi?} = prompts!(tokenizer, state, input, opts)

    on_chunk =
      if multi? do
        fn rows ->
          rows
          |> Enum.with_index()
          |> Enum.each(fn
            {%{text: ""}, _index} -> :ok
            {%{text: text}, index} -> emit_fun.({index, text})
          end)
        end
      else
        fn
          [%{text: ""}] -> :ok
          [%{text: text}] -> emit_fun.(text)
        end
      end

    generate!(tokenizer, state, prompts, opts, multi?, on_chunk)
  end

  defp generate!(tokenizer, state, prompts, opts, multi?, on_chunk) do
    stream_ref = EMLXAxon.Stream.resolve(opts.mlx_stream)

    case Generation.run(state, tokenizer, stream_ref, prompts, opts, on_chunk) do
      {:ok, %{rows: rows, stats: stats}} ->
        outputs =
          rows
          |> Enum.with_index()
          |> Enum.map(fn {row, index} -> output(row, Generation.row_timings(stats, index)) end)

        if multi?, do: outputs, else: hd(outputs)

      {:error, error} ->
        raise error
    end
  end

  defp output(row, metadata) do
    %{
      results: [
        %{
          generated_text: row.text,
          num_tokens: length(row.ids),
          token_ids: row.ids,
          finish_reason: row.finish_reason
        }
      ],
      metadata: metadata
    }
  end

  ## Helpers shared with the serving

  @doc false
  # Turns inputs into prompts (lists of token ids): `{prompts, multi?}`.
  @spec prompts!(Tokenizer.t(), State.t() | nil, term(), map()) ::
          {[[non_neg_integer()]], boolean()}
  def prompts!(tokenizer, state, input, opts) do
    {items, multi?} = normalize_input!(input)
    prompts = Enum.map(items, &encode_item!(tokenizer, &1, opts))
    if state, do: Generation.validate_prompts!(prompts, state)
    {prompts, multi?}
  end

  @doc false
  # Builds an output from generated ids by decoding them, as the engine
  # does while streaming: EOS is not decoded, and the text ends before the
  # first stop string. Used by the serving, whose results travel as tensors.
  @spec output_from_ids(Tokenizer.t(), [non_neg_integer()], finish_reason(), [String.t()], map()) ::
          output()
  def output_from_ids(tokenizer, ids, finish_reason, stop, metadata) do
    decode_ids = if finish_reason == :eos, do: Enum.drop(ids, -1), else: ids
    # A model's vocabulary is often padded past the tokenizer's; such ids
    # have no text.
    decode_ids = Enum.filter(decode_ids, &(&1 < tokenizer.vocab_size))

    text =
      case Tokenizer.decode(tokenizer, decode_ids, skip_special_tokens: true) do
        {:ok, text} -> text
        {:error, error} -> raise error
      end

    text = if finish_reason == :stop, do: cut_at_stop(text, stop), else: text
    output(%{text: text, ids: ids, finish_reason: finish_reason}, metadata)
  end

  defp cut_at_stop(text, stop) do
    stop
    |> Enum.flat_map(fn s ->
      case :binary.match(text, s) do
        {at, _} -> [at]
        :nomatch -> []
      end
    end)
    |> case do
      [] -> text
      positions -> binary_part(text, 0, Enum.min(positions))
    end
  end

  @doc false
  @spec validate_serving_opts!(term()) :: map()
  def validate_serving_opts!(opts) do
    opts = Options.validate!(opts, @serving_defaults, "EMLXAxon.TextGeneration.serving/3")

    {streaming?, mlx_stream} =
      case {opts.stream, opts.mlx_stream} do
        {stream, mlx} when stream in [nil, false, true] -> {stream == true, mlx}
        {%EMLXAxon.Stream{} = stream, nil} -> {false, stream}
        {%EMLXAxon.Stream{}, %EMLXAxon.Stream{}} -> raise ArgumentError, both_streams_message()
        {other, _} -> raise ArgumentError, bad_serving_stream_message(other)
      end

    chunk_size = opts.chunk_size || if(streaming?, do: @stream_chunk_size, else: @run_chunk_size)
    %{opts | stream: streaming?, mlx_stream: mlx_stream, chunk_size: chunk_size}
  end

  defp validate_run_opts!(opts, default_chunk_size, where) do
    opts = Options.validate!(opts, @common_defaults, where)

    mlx_stream =
      case {opts.stream, opts.mlx_stream} do
        {stream, mlx} when stream in [nil, false] ->
          mlx

        {%EMLXAxon.Stream{} = stream, nil} ->
          stream

        {%EMLXAxon.Stream{}, %EMLXAxon.Stream{}} ->
          raise ArgumentError, both_streams_message()

        {true, _} ->
          raise ArgumentError,
                "stream: true is an option of EMLXAxon.TextGeneration.serving/3; " <>
                  "to stream text here use EMLXAxon.TextGeneration.stream/5"

        {other, _} ->
          raise ArgumentError,
                "expected :stream to be an EMLXAxon.Stream, got: #{inspect(other)}"
      end

    %{
      opts
      | stream: nil,
        mlx_stream: mlx_stream,
        chunk_size: opts.chunk_size || default_chunk_size
    }
  end

  defp both_streams_message,
    do: "give the EMLXAxon.Stream to run on in either :stream or :mlx_stream, not both"

  defp bad_serving_stream_message(other),
    do: "expected :stream to be a boolean or an EMLXAxon.Stream, got: #{inspect(other)}"

  defp normalize_input!([]) do
    raise ArgumentError, "expected an input to generate from, got an empty list"
  end

  defp normalize_input!(input) when is_list(input) do
    if Enum.all?(input, &Tokenizer.message?/1) do
      {[{:chat, input}], false}
    else
      {Enum.map(input, &normalize_item!/1), true}
    end
  end

  defp normalize_input!(input), do: {[normalize_item!(input)], false}

  defp normalize_item!(text) when is_binary(text), do: {:text, text}
  defp normalize_item!(%{text: text}) when is_binary(text), do: {:text, text}
  defp normalize_item!(%{messages: messages}) when is_list(messages), do: {:chat, messages}
  defp normalize_item!(%{input_ids: ids}) when is_list(ids), do: {:ids, ids}

  defp normalize_item!([_ | _] = messages) do
    if Enum.all?(messages, &Tokenizer.message?/1) do
      {:chat, messages}
    else
      raise ArgumentError, input_error(messages)
    end
  end

  defp normalize_item!(other), do: raise(ArgumentError, input_error(other))

  defp input_error(input) do
    "expected each input to be a string, %{text: string}, %{messages: messages}, " <>
      "%{input_ids: ids} or a list of chat messages, got: #{inspect(input)}"
  end

  defp encode_item!(tokenizer, {:text, text}, %{chat: true} = opts),
    do: encode_item!(tokenizer, {:chat, [{"user", text}]}, opts)

  defp encode_item!(tokenizer, {:text, text}, _opts) do
    if text == "", do: raise(ArgumentError, "cannot generate from an empty string")
    ok!(Tokenizer.encode(tokenizer, text, add_special_tokens: true))
  end

  defp encode_item!(tokenizer, {:chat, messages}, opts) do
    prompt =
      ok!(
        Tokenizer.apply_chat_template(tokenizer, messages,
          add_generation_prompt: true,
          enable_thinking: opts.enable_thinking
        )
      )

    ok!(Tokenizer.encode(tokenizer, prompt, add_special_tokens: false))
  end

  defp encode_item!(_tokenizer, {:ids, ids}, _opts), do: ids

  defp ok!({:ok, value}), do: value
  defp ok!({:error, error}), do: raise(error)

  defp tokenizer!(%Tokenizer{} = tokenizer), do: tokenizer

  defp tokenizer!(other) do
    raise ArgumentError,
          "expected an EMLXAxon.Tokenizer (from EMLXAxon.Tokenizer.load/1), got: #{inspect(other)}"
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
