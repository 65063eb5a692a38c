defmodule EMLXAxon.TextGeneration.Config do
  @moduledoc false
  # Validates EMLXAxon.TextGeneration's options into the map the generation
  # and the serving read: every option present, `:stream` resolved into
  # "is this a streaming serving" and `:mlx_stream` the EMLXAxon.Stream to
  # run on, `:chunk_size` defaulted by use.

  alias EMLXAxon.Options

  @common_defaults Options.generation_defaults() ++
                     Options.constraint_defaults() ++
                     [
                       chat: false,
                       enable_thinking: nil,
                       tools: nil,
                       profile_timing: true,
                       timeout: :infinity,
                       chunk_size: nil,
                       stream: nil,
                       mlx_stream: nil
                     ]

  # Bumblebee's serving options are accepted so its users' code runs
  # unchanged: :compile sets the batch size and prompt length buckets,
  # :defn_options the partitions; :preallocate_params has no meaning here
  # (weights are loaded onto the device once, by the loader).
  @serving_defaults @common_defaults ++
                      [
                        stream_done: false,
                        defn_options: [],
                        compile: nil,
                        preallocate_params: false,
                        scheduler: nil
                      ]

  @loader_options [:dtype, :quantize]

  @run_chunk_size 16
  @stream_chunk_size 4

  @doc "Options `from_mlx4bit/3` passes on to the loader."
  def loader_options, do: @loader_options

  @doc "Validates `serving/3`'s options."
  @spec serving!(term()) :: map()
  def serving!(opts) do
    opts = Options.validate!(opts, @serving_defaults, "EMLXAxon.TextGeneration.serving/3")
    opts = Map.put(opts, :constraint, Options.constraint!(opts, "the options"))

    {streaming?, mlx_stream} =
      case {opts.stream, opts.mlx_stream} do
        {stream, mlx} when stream in [nil, false, true] -> {stream == true, mlx}
        {%EMLXAxon.Stream{} = stream, nil} -> {false, stream}
        {%EMLXAxon.Stream{}, %EMLXAxon.Stream{}} -> raise ArgumentError, both_streams_message()
        {other, _} -> raise ArgumentError, bad_serving_stream_message(other)
      end

    chunk_size = opts.chunk_size || if(streaming?, do: @stream_chunk_size, else: @run_chunk_size)
    schedulers!(opts.scheduler, mlx_stream)
    %{opts | stream: streaming?, mlx_stream: mlx_stream, chunk_size: chunk_size}
  end

  # A serving's :scheduler: one, or one per partition.
  defp schedulers!(nil, _mlx_stream), do: :ok

  defp schedulers!(schedulers, mlx_stream) do
    case schedulers do
      [_ | _] -> Enum.each(schedulers, &scheduler!/1)
      [] -> scheduler!([])
      scheduler -> scheduler!(scheduler)
    end

    if mlx_stream do
      raise ArgumentError,
            "an EMLXAxon.Stream (:stream or :mlx_stream) cannot be used with :scheduler: " <>
              "the scheduler runs on the stream it was started on"
    end
  end

  @doc "Validates `run/4`'s options (`streaming?` for `stream/5`)."
  @spec run!(term(), boolean(), String.t()) :: map()
  def run!(opts, streaming?, where) do
    opts = Options.validate!(opts, @common_defaults ++ [scheduler: nil], where)
    scheduler!(opts.scheduler)
    opts = Map.put(opts, :constraint, Options.constraint!(opts, "the options"))
    default_chunk_size = if streaming?, do: @stream_chunk_size, else: @run_chunk_size

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

  # A pid or a name GenServer.call/3 accepts.
  defp scheduler!(scheduler)
       when is_nil(scheduler) or is_pid(scheduler) or
              (is_atom(scheduler) and scheduler not in [true, false]) or
              (is_tuple(scheduler) and elem(scheduler, 0) in [:global, :via]) or
              (is_tuple(scheduler) and tuple_size(scheduler) == 2 and
                 is_atom(elem(scheduler, 0)) and is_atom(elem(scheduler, 1))),
       do: :ok

  defp scheduler!(other) do
    raise ArgumentError,
          "expected :scheduler to be the pid or name of an EMLXAxon.Scheduler, " <>
            "got: #{inspect(other)}"
  end

  defp both_streams_message,
    do: "give the EMLXAxon.Stream to run on in either :stream or :mlx_stream, not both"

  defp bad_serving_stream_message(other),
    do: "expected :stream to be a boolean or an EMLXAxon.Stream, got: #{inspect(other)}"
end
