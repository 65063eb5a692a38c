defmodule EMLXAxon.TextGeneration.Config do
  @moduledoc false
  # Validates EMLXAxon.TextGeneration's options into the map the generation
  # and the serving read: every option present, `:stream` resolved into
  # "is this a streaming serving" and `:mlx_stream` the EMLXAxon.Stream to
  # run on, `:chunk_size` defaulted by use.

  alias EMLXAxon.Options
  alias EMLXAxon.Qwen3.Loader

  @stream_struct {:struct, EMLXAxon.Stream, "an EMLXAxon.Stream"}

  # What a serving may set on the schedulers it starts itself.
  @scheduler_keys [
    :slots,
    :capacity,
    :prefill_chunk,
    :steps_per_call,
    :step_budget_ms,
    :prefix_cache_bytes,
    :prefix_min_tokens,
    :kv_dtype
  ]

  @common Options.generation() ++
            Options.constraints() ++
            [
              chat: [
                type: :boolean,
                default: false,
                doc: "render string inputs with the chat template, as a user message"
              ],
              enable_thinking: [
                type: {:or, [:boolean, nil]},
                default: nil,
                doc:
                  "Qwen3's thinking switch for the chat template; `nil` leaves the " <>
                    "template's default"
              ],
              tools:
                Options.tools_spec(
                  "tools offered to chat inputs; each result then gets `tool_calls` " <>
                    "(see \"Tool calls\" in the module documentation)"
                ),
              profile_timing: [
                type: :boolean,
                default: true,
                doc: "measure the prefill and decode timings (see `EMLXAxon.Result`)"
              ],
              timeout: [
                type:
                  {:custom, {Options, :timeout},
                   "a non-negative integer (milliseconds) or :infinity"},
                default: :infinity,
                doc: "time after which generation stops with `finish_reason: :timeout`"
              ],
              chunk_size: [
                type: {:or, [nil, :pos_integer]},
                default: nil,
                default_doc: "16, or 4 when streaming",
                doc:
                  "tokens decoded per native call, which is also how often a timeout is " <>
                    "checked and streamed text is delivered"
              ]
            ]

  @run_only [
    stream: [
      type: {:custom, {__MODULE__, :run_stream}, "an EMLXAxon.Stream"},
      default: nil,
      doc: "the `EMLXAxon.Stream` to run on (or give it as `:mlx_stream`)"
    ],
    mlx_stream: [
      type: {:or, [@stream_struct, nil]},
      default: nil,
      doc: "the `EMLXAxon.Stream` to run on"
    ],
    scheduler: [
      type: {:custom, {__MODULE__, :scheduler}, "the pid or name of an EMLXAxon.Scheduler"},
      default: nil,
      doc:
        "an `EMLXAxon.Scheduler` serving the same `state`, started with a `:tokenizer`: " <>
          "each input is then submitted to it as its own request (see \"Through a " <>
          "scheduler\" in the module documentation)"
    ]
  ]

  # Bumblebee's serving options are accepted so its users' code runs
  # unchanged: :compile sets the batch size and prompt length buckets,
  # :defn_options the partitions; :preallocate_params has no meaning here
  # (weights are loaded onto the device once, by the loader).
  @serving_only [
    stream: [
      type: {:custom, {__MODULE__, :serving_stream}, "a boolean or an EMLXAxon.Stream"},
      default: nil,
      doc:
        "`true` for a streaming serving (`Nx.Serving.run/2` returns a stream of text " <>
          "chunks); an `EMLXAxon.Stream` to run on"
    ],
    mlx_stream: [
      type: {:or, [@stream_struct, nil]},
      default: nil,
      doc: "the `EMLXAxon.Stream` to run on (for a streaming serving, where `:stream` is `true`)"
    ],
    scheduler: [
      type:
        {:custom, {__MODULE__, :schedulers},
         "a boolean, the pid or name of an EMLXAxon.Scheduler, or a non-empty list of them"},
      default: true,
      doc:
        "`true`: the serving decodes through `EMLXAxon.Scheduler`s of its own (continuous " <>
          "batching, see \"Continuous batching\"); `false`: each execution decodes its " <>
          "batch to the end (static batches); schedulers started elsewhere (serving the " <>
          "same `state`, with a `:tokenizer`): shared, one per partition in turn"
    ],
    max_queue:
      Options.max_queue(
        "requests that may wait for a slot of the serving's own scheduler past the running " <>
          "ones (per partition); past them a caller gets `EMLXAxon.Error` (kind " <>
          "`:overloaded`) at once"
      ),
    scheduler_options: [
      type:
        {:custom, {__MODULE__, :scheduler_options},
         "a keyword list of EMLXAxon.Scheduler.start_link/1 options"},
      default: [],
      doc:
        "options of the serving's own schedulers (`EMLXAxon.Scheduler.start_link/1`'s " <>
          "`#{Enum.map_join(@scheduler_keys, "`, `", &inspect/1)}`); without `:slots`, " <>
          "each has `compile: [batch_size: n]`'s n slots (8 without it)"
    ],
    stream_done: [
      type: :boolean,
      default: false,
      doc:
        "with a streaming serving, end the stream with `{:done, %{token_summary: summary, " <>
          "results: [result], metadata: metadata}}` (Bumblebee's final event, with the " <>
          "output `run/4` gives)"
    ],
    compile: [
      type:
        {:custom, {__MODULE__, :compile},
         "a keyword list with :batch_size (a positive integer) and/or :sequence_length " <>
           "(a positive integer or a list of them)"},
      default: nil,
      doc:
        "Bumblebee's: `:batch_size` is the serving's batch size (`Nx.Serving.batch_size/2`), " <>
          "the most inputs one execution decodes; `:sequence_length` sets the prompt length " <>
          "buckets: a prompt is sent padded to the smallest bucket it fits in, only prompts " <>
          "of one bucket are batched together, and a prompt longer than every bucket raises " <>
          "`EMLXAxon.Error` (kind `:prompt_too_long`). Without it, the buckets are the powers " <>
          "of two from 16 up to `:max_len`. Nothing is compiled ahead: MLX needs no fixed shapes"
    ],
    defn_options: [
      type: :keyword_list,
      default: [],
      doc:
        "Bumblebee's; only `:max_concurrency` is used, as the number of partitions a serving " <>
          "started with `partitions: true` runs"
    ],
    preallocate_params: [
      type: :boolean,
      default: false,
      doc: "Bumblebee's; accepted and ignored: the weights are on the device once loaded"
    ]
  ]

  @loader_options [:dtype, :quantize]

  @run_chunk_size 16
  @stream_chunk_size 4

  @doc "The schema of `run/4` and `stream/5`."
  def run_schema, do: @common ++ @run_only

  @doc "The schema of `serving/3`."
  def serving_schema, do: @common ++ @serving_only

  @doc "The schema of `from_mlx4bit/3`: the serving's and the loader's `:dtype` and `:quantize`."
  def from_mlx4bit_schema, do: serving_schema() ++ Keyword.take(Loader.schema(), @loader_options)

  @doc "Validates `from_mlx4bit/3`'s options: `{loader_opts, serving_opts}`."
  @spec from_mlx4bit!(term()) :: {keyword(), keyword()}
  def from_mlx4bit!(opts) do
    Options.validate!(opts, from_mlx4bit_schema(), "EMLXAxon.TextGeneration.from_mlx4bit/3")
    {load_opts, serving_opts} = Keyword.split(opts, @loader_options)
    # Fail on what the options check together before spending time loading.
    serving!(serving_opts)
    {load_opts, serving_opts}
  end

  ## Custom types

  @doc false
  def run_stream(value) when value in [nil, false], do: {:ok, nil}
  def run_stream(%EMLXAxon.Stream{} = stream), do: {:ok, stream}

  def run_stream(true) do
    {:error,
     {:message,
      "stream: true is an option of EMLXAxon.TextGeneration.serving/3; " <>
        "to stream text here use EMLXAxon.TextGeneration.stream/5"}}
  end

  def run_stream(_other), do: :error

  @doc false
  def serving_stream(value) when is_nil(value) or is_boolean(value), do: {:ok, value}
  def serving_stream(%EMLXAxon.Stream{} = stream), do: {:ok, stream}
  def serving_stream(_other), do: :error

  @doc false
  # A pid or a name GenServer.call/3 accepts.
  def scheduler(scheduler)
      when is_nil(scheduler) or is_pid(scheduler) or
             (is_atom(scheduler) and scheduler not in [true, false]) or
             (is_tuple(scheduler) and elem(scheduler, 0) in [:global, :via]) or
             (is_tuple(scheduler) and tuple_size(scheduler) == 2 and
                is_atom(elem(scheduler, 0)) and is_atom(elem(scheduler, 1))),
      do: {:ok, scheduler}

  def scheduler(_other), do: :error

  @doc false
  # A serving's :scheduler: one, or one per partition.
  def schedulers([_ | _] = schedulers) do
    if Enum.all?(schedulers, &(&1 != nil and scheduler(&1) != :error)),
      do: {:ok, schedulers},
      else: :error
  end

  def schedulers(flag) when is_boolean(flag), do: {:ok, flag}
  def schedulers(other), do: scheduler(other)

  @doc false
  def scheduler_options(value) do
    if Keyword.keyword?(value) and Keyword.keys(value) -- @scheduler_keys == [] do
      schema = Keyword.take(EMLXAxon.Scheduler.__schema__(:start_link), @scheduler_keys)
      Options.validate!(value, schema, "EMLXAxon.TextGeneration.serving/3's :scheduler_options")
      {:ok, value}
    else
      :error
    end
  end

  @doc false
  def compile(nil), do: {:ok, nil}

  def compile(value) when is_list(value) do
    valid? =
      Keyword.keyword?(value) and
        Enum.all?(value, fn
          {:batch_size, size} ->
            is_integer(size) and size > 0

          {:sequence_length, length} when is_integer(length) ->
            length > 0

          {:sequence_length, [_ | _] = lengths} ->
            Enum.all?(lengths, &(is_integer(&1) and &1 > 0))

          _ ->
            false
        end)

    if valid?, do: {:ok, value}, else: :error
  end

  def compile(_value), do: :error

  @doc "Validates `serving/3`'s options."
  @spec serving!(term()) :: map()
  def serving!(opts) do
    opts = Options.validate!(opts, serving_schema(), "EMLXAxon.TextGeneration.serving/3")
    opts = Map.put(opts, :constraint, Options.constraint!(opts, "the options"))

    {streaming?, mlx_stream} =
      case {opts.stream, opts.mlx_stream} do
        {stream, mlx} when stream in [nil, false, true] -> {stream == true, mlx}
        {%EMLXAxon.Stream{} = stream, nil} -> {false, stream}
        {%EMLXAxon.Stream{}, %EMLXAxon.Stream{}} -> raise ArgumentError, both_streams_message()
      end

    chunk_size = opts.chunk_size || if(streaming?, do: @stream_chunk_size, else: @run_chunk_size)
    scheduler = schedulers!(opts.scheduler, mlx_stream)
    own_cache!(opts, scheduler)
    opts = slot_dtype(opts, scheduler)

    %{
      opts
      | stream: streaming?,
        mlx_stream: mlx_stream,
        chunk_size: chunk_size,
        scheduler: scheduler
    }
  end

  # A quantized or rotating KV cache belongs to one generation: a
  # scheduler's slots do not offer it. A cache dtype is the slots' own: the
  # serving's schedulers get it, a given one must have been started with it.
  defp own_cache!(opts, scheduler) do
    given = for key <- [:kv_bits, :max_kv_size], opts[key] != nil, do: key

    if given != [] and scheduler != false do
      raise ArgumentError,
            "#{Enum.map_join(given, " and ", &inspect/1)} need static batches " <>
              "(scheduler: false): a scheduler's slots keep float caches"
    end
  end

  defp slot_dtype(%{kv_dtype: dtype} = opts, true) when dtype != nil,
    do: %{opts | scheduler_options: Keyword.put_new(opts.scheduler_options, :kv_dtype, dtype)}

  defp slot_dtype(opts, _scheduler), do: opts

  # A serving's own schedulers run on MLX's default stream: one given an
  # EMLXAxon.Stream to run on decodes static batches on it instead.
  defp schedulers!(true, mlx_stream), do: mlx_stream == nil
  defp schedulers!(false, _mlx_stream), do: false

  defp schedulers!(schedulers, mlx_stream) do
    if mlx_stream do
      raise ArgumentError,
            "an EMLXAxon.Stream (:stream or :mlx_stream) cannot be used with :scheduler: " <>
              "the scheduler runs on the stream it was started on"
    end

    schedulers
  end

  @doc "Validates `run/4`'s options (`streaming?` for `stream/5`)."
  @spec run!(term(), boolean(), String.t()) :: map()
  def run!(opts, streaming?, where) do
    opts = Options.validate!(opts, run_schema(), where)
    opts = Map.put(opts, :constraint, Options.constraint!(opts, "the options"))
    default_chunk_size = if streaming?, do: @stream_chunk_size, else: @run_chunk_size

    mlx_stream =
      case {opts.stream, opts.mlx_stream} do
        {nil, mlx} -> mlx
        {stream, nil} -> stream
        {_stream, _mlx} -> raise ArgumentError, both_streams_message()
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
end
