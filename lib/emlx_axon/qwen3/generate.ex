defmodule EMLXAxon.Qwen3.Generate do
  @moduledoc """
  Autoregressive token generation from token ids.

  The whole loop runs natively on MLX: the prompt is prefilled in one
  forward pass, then tokens are sampled and fed back, with the KV cache
  kept on the device. Elixir drives it in chunks of tokens, so a
  generation never holds a scheduler for long, can be stopped by a
  `:timeout`, and its KV cache is freed as soon as it finishes.

  Several prompts given together are decoded as one batch, each row
  stopping on its own (EOS, stop string, `:max_new_tokens` or `:max_len`).

  For text in and text out, see `EMLXAxon.TextGeneration`.

  ## Usage

      {:ok, state} = EMLXAxon.Qwen3.Loader.load(model_path)
      {:ok, tokenizer} = EMLXAxon.Tokenizer.load(model_path)
      {:ok, input_ids} = EMLXAxon.Tokenizer.encode(tokenizer, "The capital of France is")

      {:ok, %{token_ids: ids, text: text, finish_reason: :length, metadata: metadata}} =
        EMLXAxon.Qwen3.Generate.generate(state, input_ids, max_new_tokens: 16, tokenizer: tokenizer)

  The result's keys are those of every API (see `EMLXAxon.Result`).
  """

  alias EMLXAxon.{Error, Generation, Options, Result}
  alias EMLXAxon.Qwen3.Model.State

  @schema (Options.generation() ++
             Options.constraints() ++
             [
               tokenizer: [
                 type:
                   {:or,
                    [
                      {:struct, EMLXAxon.Tokenizer,
                       "an EMLXAxon.Tokenizer (from EMLXAxon.Tokenizer.load/1)"},
                      nil
                    ]},
                 default: nil,
                 doc:
                   "enables `:stop` and the constraints, decodes `:text`, and adds the " <>
                     "tokenizer's EOS tokens"
               ],
               profile_timing: [
                 type: :boolean,
                 default: false,
                 doc:
                   "measure the prefill and decode timings (see `t:timings/0`); without it " <>
                     "the engine takes no timestamps at all"
               ],
               stream: [
                 type: {:or, [{:struct, EMLXAxon.Stream, "an EMLXAxon.Stream"}, nil]},
                 default: nil,
                 default_doc:
                   "the process's `EMLXAxon.Stream.with_stream/2` stream, else MLX's default",
                 doc: "the `EMLXAxon.Stream` to run on"
               ],
               timeout: [
                 type:
                   {:custom, {Options, :timeout},
                    "a non-negative integer (milliseconds) or :infinity"},
                 default: :infinity,
                 doc:
                   "time after which unfinished rows stop with `finish_reason: :timeout`, " <>
                     "checked between chunks"
               ],
               chunk_size: [
                 type: :pos_integer,
                 default: 16,
                 doc: "tokens decoded per native call"
               ],
               on_chunk: [
                 type: {:or, [{:fun, 1}, nil]},
                 default: nil,
                 doc:
                   "called in the calling process after each native call with one map per " <>
                     "prompt, in order: `%{ids: [integer], text: binary, finish_reason: atom | nil}` " <>
                     "(the new ids and text). The first call comes after the first token alone, " <>
                     "so it marks the time to first token as the caller sees it. Raising in it " <>
                     "stops generation and frees its memory"
               ]
             ])
          |> Options.put(:stop,
            doc: "strings ending generation (`finish_reason: :stop`); needs `:tokenizer`"
          )

  @typedoc """
  The result of generating from one prompt: an `EMLXAxon.Result` with its
  `:metadata`, also under `:timings`.
  """
  @type result :: %{
          required(:token_ids) => [non_neg_integer()],
          required(:text) => String.t(),
          required(:generated_text) => String.t(),
          required(:num_tokens) => non_neg_integer(),
          required(:finish_reason) => :eos | :stop | :length | :max_len | :timeout,
          required(:token_summary) => map(),
          required(:metadata) => timings(),
          required(:timings) => timings()
        }

  @typedoc """
  Token counts, timings and engine paths (see `EMLXAxon.Result`).
  `prompt_tokens` and `generated_tokens` are this prompt's; the times are
  the whole batch's.

  Always measured: the token counts, `batch_size` and `total_ms` (the wall
  time of the call, measured in Elixir). Measured only with
  `profile_timing: true`, and 0.0 otherwise: `prefill_ms`, `decode_ms`,
  `decode_tokens_per_s` and `time_to_first_token_ms`. Without it the engine
  takes no timestamps at all, and does not wait for the prefill to finish
  before queuing the first decode step.
  """
  @type timings :: %{
          prompt_tokens: non_neg_integer(),
          generated_tokens: non_neg_integer(),
          batch_size: pos_integer(),
          prefill_ms: float(),
          decode_ms: float(),
          decode_tokens_per_s: float(),
          time_to_first_token_ms: float(),
          total_ms: float(),
          forced_tokens: non_neg_integer(),
          decode_path: String.t() | nil,
          prefill_path: String.t() | nil,
          fallbacks: [String.t()] | nil
        }

  @doc """
  Generates tokens following `input_ids`.

  `input_ids` is a list of token ids, or a list of such lists to decode
  several prompts as one batch (then a list of results is returned, in
  order). An `Nx.Tensor` of shape `{n}` or `{batch, n}` works too (where
  Nx is installed); a `{1, n}` tensor counts as a single prompt.

  The generated `token_ids` include the EOS token when generation stopped
  on one (`finish_reason: :eos`); `text` never includes it, nor the
  matched stop string. At least one token is always generated.

  The result is an `EMLXAxon.Result` (see there for its keys) with its
  `:metadata` (`t:timings/0`), which is also under `:timings`.

  ## Options

  #{Options.docs(@schema)}

  ## Examples

      {:ok, %{token_ids: [_ | _], finish_reason: reason}} =
        EMLXAxon.Qwen3.Generate.generate(state, [785, 6722, 315, 9625, 374], max_new_tokens: 8)

      # Two prompts decoded as one batch:
      {:ok, [first, second]} =
        EMLXAxon.Qwen3.Generate.generate(state, [[785, 6722], [9707, 11]], max_new_tokens: 8)

      # Sampling, reproducibly:
      {:ok, result} =
        EMLXAxon.Qwen3.Generate.generate(state, ids, sampler: :top_p_cpu, top_p: 0.9, seed: 42)

      {:error, %EMLXAxon.Error{kind: :prompt_too_long}} =
        EMLXAxon.Qwen3.Generate.generate(state, ids, max_len: 2)

  """
  @spec generate(State.t(), [non_neg_integer()] | [[non_neg_integer()]] | struct(), keyword()) ::
          {:ok, result() | [result()]} | {:error, Error.t()}
  def generate(state, input_ids, opts \\ [])

  def generate(%State{} = state, input_ids, opts) do
    opts = Options.validate!(opts, @schema, "EMLXAxon.Qwen3.Generate.generate/3")

    Options.check_stop_needs_tokenizer!(
      opts,
      opts.tokenizer,
      "EMLXAxon.Qwen3.Generate.generate/3"
    )

    {prompts, multi?} = prompts!(input_ids)
    prompts = Generation.validate_prompts!(prompts, state)
    opts = put_constraints(opts, length(prompts))

    with {:ok, %{rows: rows, stats: stats}} <-
           Generation.run(
             state,
             opts.tokenizer,
             EMLXAxon.Stream.resolve(opts.stream),
             prompts,
             opts,
             opts.on_chunk
           ) do
      paddings = Result.paddings(stats.prompt_tokens)

      results =
        rows
        |> Enum.with_index()
        |> Enum.map(fn {row, index} ->
          metadata = Generation.row_timings(stats, index)
          padding = Enum.at(paddings, index)

          row.ids
          |> Result.new(row.text, row.finish_reason, metadata.prompt_tokens, padding)
          |> Map.merge(%{metadata: metadata, timings: metadata})
        end)

      {:ok, if(multi?, do: results, else: hd(results))}
    end
  end

  def generate(state, _input_ids, _opts) do
    raise ArgumentError,
          "expected an EMLXAxon.Qwen3.Model.State (from EMLXAxon.Qwen3.Loader.load/2), " <>
            "got: #{inspect(state)}"
  end

  @doc false
  # The option schema, for tests and tools that read it.
  def __schema__(:generate), do: @schema

  defp put_constraints(opts, rows) do
    case Options.constraint!(opts, "EMLXAxon.Qwen3.Generate.generate/3") do
      nil ->
        opts

      constraint ->
        if opts.tokenizer == nil do
          raise ArgumentError,
                "constrained decoding works on the tokens' text, so " <>
                  "EMLXAxon.Qwen3.Generate.generate/3 needs the :tokenizer option with it"
        end

        Map.put(opts, :row_constraints, List.duplicate(constraint, rows))
    end
  end

  defp prompts!(%{__struct__: Nx.Tensor} = tensor) do
    # Nx is optional: call it dynamically so this compiles without it.
    case apply(Nx, :shape, [tensor]) do
      {_n} ->
        {[apply(Nx, :to_flat_list, [tensor])], false}

      {1, _n} ->
        {apply(Nx, :to_list, [tensor]), false}

      {_batch, _n} ->
        {apply(Nx, :to_list, [tensor]), true}

      shape ->
        raise ArgumentError,
              "expected input_ids of shape {n} or {batch, n}, got: #{inspect(shape)}"
    end
  end

  defp prompts!([first | _] = prompts) when is_list(first), do: {prompts, true}
  defp prompts!([_ | _] = ids), do: {[ids], false}

  defp prompts!(other) do
    raise ArgumentError,
          "expected input_ids to be a non-empty list of token ids or a list of such lists, " <>
            "got: #{inspect(other)}"
  end
end
